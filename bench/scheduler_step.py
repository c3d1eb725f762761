"""Per-step cost outside the model's math, at KV pools of 10^4, 10^5 and 10^6 pages.

    cd bench && ../.venv/bin/python scheduler_step.py [scheduler|worker|both] [STEPS]
    cd bench && ../.venv/bin/python scheduler_step.py burst [N ...]

`scheduler`: the scheduler's CPU time (thread time) per step with 256 running sequences, as its batching loop
spends it: schedule(), the plan to protobuf, the worker's answer from protobuf, update(), and the
step's page events for the kvcache service (its prefix-index changes and page counts, as the
publisher collects them); the kvcache service's handling of those events is printed beside it.
No model: the "worker" answers at once with one token for every sequence the step brings level
(not timed). Requests have 64..320-token prompts (a quarter share a 128-token system prompt) and
64..256 output tokens (256 such sequences fit in the smallest pool), so sequences finish and new ones are admitted all along, and the pool is
first fragmented by a burst of short requests.
`worker`: the worker core's time per step outside the model's forward pass (applying the plan,
building the flattened batch, sampling bookkeeping, the result to protobuf) for 256 decoding
sequences on a tiny model whose KV pool has the same page counts (bfloat16, one KV head of 16),
on one torch thread.
Prints mean and median milliseconds per step and the ratio of the 10^6-page step to the
10^4-page step (the target: within 1.25x, and under 2 ms for the scheduler).
`burst`: the scheduler's CPU time for a burst of N requests submitted at once to one worker
(10^6 pages; default N: 640, 2,560, 10,240), as each submit spends it on that worker: the
overload estimate (the newcomer's wait behind the queue) and queueing the request. Prints the
milliseconds per submit, which should not grow with N.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

POOLS = (10**4, 10**5, 10**6)
RUNNING = 256


def requests(rng: random.Random, n: int, start: int):
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.request import Request

    system = [rng.randrange(32000) for _ in range(128)]
    for i in range(start, start + n):
        prompt = [rng.randrange(32000) for _ in range(rng.randint(64, 320))]
        if i % 4 == 0:
            prompt = system + prompt[:192]
        yield Request(f"r{i}", prompt, SamplingParams(temperature=0.0),
                      StoppingParams(max_new_tokens=rng.randint(64, 256)), eos_token_ids=())


def answer(plan, request_ids_level) -> "object":
    """The worker's StepResult proto: a token for each sequence the step brings level."""
    from kvmesh.v1 import worker_pb2 as wk

    return wk.StepResult(tokens=[wk.SampledToken(seq_id=s, token_id=7, logprob=-1.0) for s in request_ids_level])


def scheduler_steps(num_pages: int, steps: int) -> list[float]:
    from kvmesh.services import wire
    from kvmesh.services.kvcache.index import WorkerIndex
    from kvmesh.services.scheduler.core import Scheduler, SchedulerConfig
    from kvmesh.services.scheduler.kv_events import KVPublisher, TracedPagePool

    rng = random.Random(0)
    pool = TracedPagePool("w", num_pages, 16)
    publisher = KVPublisher(pool, "w", epoch=1, lease_token=1, kvcache=lambda: None)
    publisher.resync = False  # changes since the last call, as in steady state
    index = WorkerIndex(1, 1, num_pages, 16)
    core = Scheduler(pool, SchedulerConfig(max_batched_tokens=2048, max_num_seqs=RUNNING, max_prefill_chunk=512))
    feed = requests(rng, 10**7, 0)
    times, shape, replay = [], [], []
    for step in range(steps + 200):  # the first 200 steps fill the batch (not measured)
        while len(core.waiting) < 32:
            core.add(next(feed))
        t0 = time.thread_time()
        plan = core.schedule()
        msg = wire.plan_to_proto(step, plan)
        t1 = time.thread_time()
        level = [c.seq_id for c in plan.scheduled
                 if core.requests[c.seq_id].num_computed_tokens + c.num_tokens == core.requests[c.seq_id].num_tokens]
        reply = answer(msg, level)
        t2 = time.thread_time()
        core.update(plan, wire.result_from_proto(reply))
        publisher.after_step()
        events = publisher._request()  # one call per step: the most a busy kvcache could be sent
        t3 = time.thread_time()
        index.apply(events.stored, events.evicted)  # the kvcache service's side of the call
        t4 = time.thread_time()
        if step >= 200:
            times.append((t1 - t0) + (t3 - t2))
            replay.append(t4 - t3)
            shape.append((len(plan.scheduled), plan.num_tokens))
    seqs, tokens = (statistics.mean(x) for x in zip(*shape))
    print(f"          per step: {seqs:.0f} sequences, {tokens:.0f} tokens; {core.num_preemptions} preemptions in all; "
          f"kvcache index update {1000 * statistics.mean(replay):.3f} ms/step")
    return times


def worker_steps(num_pages: int, steps: int) -> list[float]:
    import torch

    from kvmesh.modelgen import make_model
    from kvmesh.params import SamplingParams
    from kvmesh.services import wire
    from kvmesh.services.worker.model import CausalLM
    from kvmesh.services.worker.runner import ModelRunner
    from kvmesh.step import NewSequence, ScheduledChunk, StepPlan
    import tempfile

    torch.set_num_threads(1)  # overhead, not parallel speed-up: one thread measures steadily on a busy machine
    folder = tempfile.mkdtemp()
    make_model(folder, vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
               num_kv_heads=1, max_position_embeddings=4096)
    model = CausalLM.load(folder, dtype="bfloat16")
    runner = ModelRunner(model, num_pages, 16)
    forward_s = 0.0
    forward = model.forward

    def timed_forward(*args):
        nonlocal forward_s
        t = time.thread_time()
        out = forward(*args)
        forward_s += time.thread_time() - t
        return out

    model.forward = timed_forward
    rng = random.Random(0)
    next_page, lengths = 0, {}
    new = []
    for i in range(RUNNING):  # 256 sequences of 200..600 tokens, pages spread over the pool
        n = rng.randint(200, 600)
        pages = list(range(next_page, next_page + -(-(n + 1024) // 16)))
        next_page = pages[-1] + 1 + (num_pages - RUNNING * 104) // RUNNING
        lengths[f"s{i}"] = (n, pages)
        new.append(NewSequence(f"s{i}", [rng.randrange(512) for _ in range(n)], n, SamplingParams(temperature=0.0),
                               pages, n - 1))
    runner.step(StepPlan(new=new, scheduled=[ScheduledChunk(s, 1) for s in lengths]))
    times = []
    for step in range(steps + 5):
        msg = wire.plan_to_proto(step, StepPlan(scheduled=[ScheduledChunk(s, 1) for s in lengths]))
        forward_s = 0.0
        t0 = time.thread_time()
        result = runner.step(wire.plan_from_proto(msg))
        wire.result_to_proto(step, result)
        total = time.thread_time() - t0
        if step >= 5:
            times.append(total - forward_s)
    return times


def burst(n: int) -> float:
    """Thread seconds of `n` submits at once, each estimated and queued on one worker's loop."""
    from prometheus_client import CollectorRegistry

    from kvmesh.metrics import SchedulerMetrics
    from kvmesh.services.config import SchedulerServiceConfig
    from kvmesh.services.scheduler.worker_loop import WorkerLoop
    from kvmesh.v1 import worker_pb2

    info = worker_pb2.WorkerInfo(num_pages=10**6, page_size=16, max_context=4096)
    loop = WorkerLoop({"id": "w", "address": "w:1"}, info, SchedulerServiceConfig(), None,
                      SchedulerMetrics(CollectorRegistry()))
    loop.throughput.record(2048, 1.0, sequences=8)  # measured rates, as after a warm-up: estimates are not 0
    loop.throughput.record(64, 0.05, sequences=64)
    burst = list(requests(random.Random(0), n, 0))
    t0 = time.thread_time()
    for req in burst:
        loop.estimated_wait_s(req)
        loop.submit(req, [], 0)
    return time.thread_time() - t0


def report(name: str, measure, steps: int) -> None:
    per = {}
    for pages in POOLS:
        t = measure(pages, steps)
        per[pages] = statistics.mean(t)
        print(f"{name:<9} {pages:>9,} pages: {1000 * statistics.mean(t):6.3f} ms/step mean, "
              f"{1000 * statistics.median(t):6.3f} median ({len(t)} steps, {RUNNING} sequences)", flush=True)
    print(f"{name:<9} 10^6 / 10^4 pages: {per[POOLS[-1]] / per[POOLS[0]]:.2f}x", flush=True)


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    if which == "burst":
        for n in map(int, sys.argv[2:] or (640, 2560, 10240)):
            seconds = burst(n)
            print(f"burst of {n:>6,} submits: {1000 * seconds:8.1f} ms in all, {1000 * seconds / n:.3f} ms per submit",
                  flush=True)
        return
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 600
    if which in ("scheduler", "both"):
        report("scheduler", scheduler_steps, steps)
    if which in ("worker", "both"):
        report("worker", worker_steps, min(steps, 100))


if __name__ == "__main__":
    main()
