"""The worker's gRPC adapter: `Worker/Step` (one bidirectional stream per scheduler) and `Info`.

Startup: the server listens at once (health NOT_SERVING), loads the weights, runs a warm-up
step, then turns SERVING and registers in Redis with a fresh epoch. A new Step stream means a
new owner (a restarted scheduler): the worker forgets every sequence of the previous stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from pathlib import Path

import grpc

from kvmesh.params import SamplingParams
from kvmesh.services import wire
from kvmesh.services.config import CommonConfig, WorkerConfig
from kvmesh.services.grpc_server import ServiceServer, advertised_address, serve_until_stopped
from kvmesh.services.registry import Registry
from kvmesh.services.worker.model import CausalLM
from kvmesh.services.worker.runner import KVPool, ModelRunner
from kvmesh.step import NewSequence, ScheduledChunk, StepPlan
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("kvmesh.worker")


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Step: StepRequest in, StepResult out, one per step, in order. A step that raises answers
    with `error` set and the stream stays open. Info: what the scheduler needs to plan pages."""

    def __init__(self):
        self.runner: ModelRunner | None = None
        # Every step runs on this one thread: torch's OpenMP pool belongs to the calling thread,
        # and steps hopping between executor threads would keep several pools alive and spinning.
        self._compute = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        self.info = worker_pb2.WorkerInfo()
        self._stream_owner = 0

    async def Step(self, request_iterator, context):
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model")
        self._stream_owner += 1
        owner = self._stream_owner
        self.runner.seqs.clear()  # a new scheduler stream owns this worker from now on
        async for request in request_iterator:
            if owner != self._stream_owner:
                await context.abort(grpc.StatusCode.ABORTED, "another scheduler stream took over this worker")
            plan = wire.plan_from_proto(request)
            try:
                result = await asyncio.get_running_loop().run_in_executor(self._compute, self.runner.step, plan)
            except Exception as e:  # one bad step must not take the worker down
                log.exception("step %d failed", request.step)
                for chunk in plan.scheduled:
                    self.runner.seqs.pop(chunk.seq_id, None)
                yield worker_pb2.StepResult(step=request.step, error=f"{type(e).__name__}: {e}")
                continue
            yield wire.result_to_proto(request.step, result)

    async def Info(self, request, context):
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model")
        return self.info


def load_runner(cfg: WorkerConfig) -> ModelRunner:
    from kvmesh.modelgen import default_model_dir

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    model = CausalLM.load(cfg.model or default_model_dir(), cfg.dtype or None)
    num_pages = KVPool.pages_for_budget(model, cfg.kv_memory_mib << 20, cfg.page_size)
    runner = ModelRunner(model, num_pages, cfg.page_size)
    warm_up(runner)
    return runner


def warm_up(runner: ModelRunner) -> None:
    """One real step (prefill and sample) so the first request pays no first-call costs."""
    plan = StepPlan(new=[NewSequence("warm-up", [1, 2, 3], 3, SamplingParams(temperature=0.0), [0])],
                    scheduled=[ScheduledChunk("warm-up", 3)])
    runner.step(plan)
    runner.seqs.clear()


async def serve(common: CommonConfig, cfg: WorkerConfig) -> None:
    service = WorkerService()
    server = ServiceServer(["kvmesh.v1.Worker"], lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(service, s),
                           common.host, cfg.port)
    await server.start()
    address = advertised_address(common, server.port)
    worker_id = cfg.worker_id or address
    log.info("worker %s listening on %s, loading model", worker_id, address)
    service.runner = runner = await asyncio.get_running_loop().run_in_executor(service._compute, load_runner, cfg)
    registry = Registry(common.redis_url)
    epoch = await registry.next_epoch(worker_id)
    model_dir = Path(cfg.model) if cfg.model else None
    mcfg = runner.model.cfg
    service.info = worker_pb2.WorkerInfo(
        worker_id=worker_id, model=str(model_dir or "default"), num_pages=runner.pool.num_pages, page_size=runner.page_size,
        max_context=mcfg.max_position_embeddings, vocab_size=mcfg.vocab_size, eos_token_ids=list(mcfg.eos_token_ids),
        epoch=epoch)
    print(f"worker {worker_id} ready on {address} ({runner.pool.num_pages} KV pages, epoch {epoch})", flush=True)
    await serve_until_stopped(server, registry, "worker", worker_id,
                              {"address": address, "epoch": epoch, "num_pages": runner.pool.num_pages})
