"""KV pages that move (issue 16, part 3): a worker's page map and host-memory tier, pages read
from one worker into another, and through the mesh a prefix served by transfer from a peer or
from the tier, exact against transformers, with a source that dies mid-way."""

import asyncio
import random
import re
import threading
import urllib.request

import grpc
import pytest
import torch

from kvmesh.params import SamplingParams
from kvmesh.services.kvcache.pages import prefix_hashes
from kvmesh.services.worker.model import CausalLM
from kvmesh.services.worker.page_store import PageStore
from kvmesh.services.worker.runner import ModelRunner
from kvmesh.step import NewSequence, ScheduledChunk, StepPlan
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import Mesh, collect, lookup, wait_idle
from reference import assert_matches_reference, hf_greedy

GREEDY = SamplingParams(temperature=0.0)
PS = 16


def random_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def run_greedy(runner: ModelRunner, seq_id: str, ids: list[int], pages: list[int], n: int, computed: int = 0):
    """Greedy tokens of one sequence run alone on `runner`, its first `computed` tokens' KV already in `pages`."""
    plan = StepPlan(new=[NewSequence(seq_id, ids, len(ids), GREEDY, pages, computed)],
                    scheduled=[ScheduledChunk(seq_id, len(ids) - computed)])
    tokens, logprobs = [], []
    for _ in range(n):
        [tok] = runner.step(plan).tokens
        tokens.append(tok.token_id)
        logprobs.append(tok.logprob)
        plan = StepPlan(scheduled=[ScheduledChunk(seq_id, 1)])
    runner.seqs.pop(seq_id)
    return tokens, logprobs


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    return model_dir, CausalLM.load(model_dir)


def test_a_computed_page_is_registered_under_the_prefix_index_hash_and_read_back(llama):
    _, model = llama
    runner = ModelRunner(model, num_pages=16)
    ids = random_ids(40, seed=1)  # two full pages and a partial one
    run_greedy(runner, "a", ids, [3, 4, 5], 2)
    hashes = prefix_hashes(ids + [0], PS)  # both full pages (the index keeps the last token's page out)
    assert len(hashes) == 2 and runner.store.page_of == {hashes[0]: 3, hashes[1]: 4}
    pages = list(runner.store.read(hashes + [b"x" * 16]))  # stops at the first it does not hold
    assert [h for h, *_ in pages] == hashes
    h, k, v, from_tier = pages[1]
    assert not from_tier and torch.equal(k, runner.pool.k[:, 4 * PS : 5 * PS]) and torch.equal(v, runner.pool.v[:, 4 * PS : 5 * PS])


def test_pages_read_from_one_worker_and_written_into_another_give_transformers_tokens(llama):
    """Worker A computes a prompt; B gets its two full pages by copy, runs the rest: same tokens."""
    model_dir, model = llama
    a, b = ModelRunner(model, num_pages=16), ModelRunner(model, num_pages=16)
    ids = random_ids(45, seed=2)
    want, _ = run_greedy(a, "a", ids, [0, 1, 2], 1)
    hashes = prefix_hashes(ids, PS)
    for page, (h, k, v, _) in zip([9, 11], a.store.read(hashes)):
        b.store.write(page, h, k, v)
    tokens, logprobs = run_greedy(b, "b", ids, [9, 11, 12, 13], 12, computed=2 * PS)
    assert tokens[0] == want[0]
    assert assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, ids, 12)) >= 12


def test_pages_handed_out_go_to_the_tier_least_recently_used_out_and_are_reported(llama):
    _, model = llama
    runner = ModelRunner(model, num_pages=8, offload_bytes=3 * PS * model.cfg.kv_bytes_per_token)
    assert runner.store.tier_capacity == 3
    ids = random_ids(81, seed=3)  # five full pages
    run_greedy(runner, "a", ids, [0, 1, 2, 3, 4, 5], 1)
    hashes = prefix_hashes(ids + [0], PS)
    before = {h: (runner.pool.k[:, p * PS : (p + 1) * PS].clone()) for h, p in runner.store.page_of.items()}
    # A new sequence overwrites pages 0..4: their content goes to the tier, which keeps the last
    # three; the step's result reports what entered and left it.
    b = random_ids(20, seed=4)
    result = runner.step(StepPlan(new=[NewSequence("b", b, len(b), GREEDY, [0, 1, 2, 3, 4])],
                                  scheduled=[ScheduledChunk("b", len(b))]))
    assert result.tier_stored == hashes and result.tier_evicted == hashes[:2]
    assert list(runner.store.tier) == hashes[2:] and runner.store.tier_bytes == 3 * runner.store.page_bytes
    assert not set(hashes) & set(runner.store.page_of)  # the pool holds none of them any more
    read = list(runner.store.read(hashes[2:]))
    assert all(from_tier for *_, from_tier in read)
    assert all(torch.equal(k, before[h]) for h, k, _, _ in read)
    assert list(runner.store.read(hashes)) == []  # the first page left the tier: nothing leads


def test_a_reader_never_gets_a_page_overwritten_while_it_copied():
    """A writer keeps putting new content into two pages in turn while a reader reads whatever
    they hold: every page the reader gets holds the content of the hash it came with."""
    k = torch.zeros(8, 4 * PS, 8, 128)  # half a megabyte a page: a copy long enough to be overlapped
    v = torch.zeros_like(k)
    store = PageStore(k, v, PS)
    hashes = [bytes([i]) * 16 for i in range(50)]
    stop = threading.Event()
    writes = [0]

    def writer():  # a page handed out every millisecond or so, as a busy worker's steps would
        while not stop.wait(0.001):
            i = writes[0] % 50
            fill = torch.full((8, PS, 8, 128), float(i))
            store.write(1 + i % 2, hashes[i], fill, fill)
            writes[0] += 1

    thread = threading.Thread(target=writer)
    thread.start()
    got = 0
    try:
        while got < 1000 and writes[0] < 50_000:
            for h in list(store.page_of.copy()):
                for got_h, kk, vv, _ in store.read([h]):
                    i = hashes.index(got_h)
                    assert got_h == h and bool((kk == i).all()) and bool((vv == i).all())
                    got += 1
    finally:
        stop.set()
        thread.join()
    assert got >= 1000 and writes[0] > 10, (got, writes[0])


# --- through the mesh ----------------------------------------------------------------------------

def ids_request(ids, n=8):
    return gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=ids), sampling=gen.SamplingParams(temperature=0.0),
                               stopping=gen.StoppingParams(max_new_tokens=n, ignore_eos=True))


def generate(addr, request):
    async def run():
        async with grpc.aio.insecure_channel(addr) as ch:
            return await collect(generation_pb2_grpc.GenerationStub(ch), request)

    return asyncio.run(run())


def scrape(address: str, name: str, **labels) -> float:
    """The value of the series `name` with these labels (in any order) on a service's /metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "{") and dict(re.findall(r'(\w+)="([^"]*)"', series)) == labels:
            return float(value)
    raise AssertionError(f"no series {name}{labels} on {address}")


def on_another_worker(mesh, prefix, holder, seed):
    """Sends prompts sharing `prefix` until one runs on a worker other than `holder` (the router
    alternates schedulers, each owning one worker); returns (prompt, tokens, logprobs, finish)."""
    for attempt in range(4):
        prompt = prefix + random_ids(9, seed=seed + attempt)
        tokens, logprobs, _, finish = generate(mesh.addr, ids_request(prompt, 8))
        if finish.worker_id != holder:
            return prompt, tokens, logprobs, finish
    raise AssertionError(f"every request went to {holder}")


@pytest.fixture(scope="module")
def pair(model_dir, receiver):
    """Two schedulers owning one worker each; the router alternates between them, and schedulers
    fetch whenever a peer holds more of a prompt than their worker. Traces go to `receiver`."""
    m = Mesh(model_dir, workers=2, schedulers=2, extra_router=["--scheduler-choice", "round-robin"],
             extra_scheduler=["--kv-fetch", "always"], env=receiver.env)
    m.owner = m.wait_split()
    yield m
    m.close()


def test_a_prefix_computed_on_one_worker_is_served_on_another_by_transfer(pair, model_dir, receiver):
    prefix = random_ids(960, seed=10)  # 60 pages
    first = prefix + [7, 8, 9]
    *_, seeded = generate(pair.addr, ids_request(first, 4))
    assert seeded.transferred_prompt_tokens == 0
    prompt, tokens, logprobs, finish = on_another_worker(pair, prefix, seeded.worker_id, seed=100)
    assert finish.reason == gen.LENGTH
    assert finish.cached_prompt_tokens == finish.transferred_prompt_tokens == 960, finish
    assert finish.transfer_source == "peer"
    assert assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, prompt, 8)) >= 8
    # Both workers now hold the prefix, as kvcache's index shows, and every page came back (the
    # pages reserved for the fetch are cached now, none held by a finished request).
    held = asyncio.run(lookup(pair.kvcache_addr, prefix_hashes(first, 16)))
    pages = asyncio.run(wait_idle(pair.kvcache_addr, workers=2))
    assert len(pages) == 2 and all(w.used_pages == 0 for w in pages), pages
    assert {w.worker_id for w in held if w.pages == 60} == set(pair.owner)
    sched = next(c for c in pair.children if c.name.startswith("scheduler") and pair.owner[finish.worker_id] == c.address)
    labels = dict(model_name="default", worker=finish.worker_id, source="peer")
    assert scrape(sched.http, "kvmesh_prefix_cache_hits_by_source_total", **labels) >= 960
    assert scrape(sched.http, "kvmesh_kv_transfer_bytes_total", **labels) > 0
    assert scrape(sched.http, "kvmesh_kv_transfers_total", **labels, outcome="ok") >= 1
    # The trace shows the fetch under the scheduler's span, before the request was queued.
    spans = receiver.wait_for(bytes.fromhex(finish.trace_id), lambda s: any(x.name == "kvmesh.kv.fetch" for _, x in s)
                              and any(x.name == "kvmesh.queue" for _, x in s)
                              and any(x.name == "kvmesh.schedule" for _, x in s))
    fetch, = [x for _, x in spans if x.name == "kvmesh.kv.fetch"]
    schedule, = [x for _, x in spans if x.name == "kvmesh.schedule"]
    queue, = [x for _, x in spans if x.name == "kvmesh.queue"]
    attrs = {a.key: a.value for a in fetch.attributes}
    assert fetch.parent_span_id == schedule.span_id and fetch.end_time_unix_nano <= queue.end_time_unix_nano
    assert attrs["kvmesh.fetch_source"].string_value == "peer" and attrs["kvmesh.fetched_pages"].int_value == 60
    assert attrs["kvmesh.outcome"].string_value == "ok"


def test_only_the_owning_scheduler_may_have_a_worker_fetch_pages(pair):
    """FetchPages writes into pages its caller reserved: a caller without the worker's current
    lease token (a scheduler that lost the worker, anyone else) is refused, and ReadPages refuses
    a reader whose page layout differs."""
    from kvmesh.v1 import worker_pb2, worker_pb2_grpc

    async def calls(address):
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            info = await stub.Info(worker_pb2.InfoRequest())
            fetch = worker_pb2.FetchPagesRequest(source="", hashes=[b"x" * 16], page_ids=[0])
            refused = []
            for token in ("", "0", str(info.lease_token - 1)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.FetchPages(fetch, metadata=(("kvmesh-lease-token", token),) if token else ())
                refused.append((err.value.code(), err.value.details()))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.ReadPages(worker_pb2.ReadPagesRequest(hashes=[b"x" * 16], page_bytes=info.page_bytes + 2,
                                                                            dtype="float32")):
                    pass
            return info, refused, (err.value.code(), err.value.details())

    worker = next(c for c in pair.children if c.name.startswith("worker"))
    info, refused, layout = asyncio.run(calls(worker.address))
    assert info.lease_token > 0
    assert info.step_tokens == 1024  # its step size on a CPU in float32, which its scheduler steps by
    assert all(code == grpc.StatusCode.FAILED_PRECONDITION and "is not the lease token" in why for code, why in refused)
    assert layout[0] == grpc.StatusCode.FAILED_PRECONDITION and "page layout differs" in layout[1]


def test_without_fetching_the_other_worker_computes_the_prefix(model_dir):
    mesh = Mesh(model_dir, workers=2, schedulers=2, extra_router=["--scheduler-choice", "round-robin"],
                extra_scheduler=["--kv-fetch", "never"])
    try:
        mesh.wait_split()
        prefix = random_ids(480, seed=20)
        *_, seeded = generate(mesh.addr, ids_request(prefix + [1, 2], 2))
        _, _, _, finish = on_another_worker(mesh, prefix, seeded.worker_id, seed=200)
        assert finish.cached_prompt_tokens == finish.transferred_prompt_tokens == 0
    finally:
        mesh.close()


def test_a_transfer_whose_source_dies_mid_way_falls_back_to_recompute_exactly(model_dir):
    """The source worker SIGKILLs itself after sending 5 pages (TESTING ONLY flag): the fetching
    worker keeps the pages that arrived and computes the rest; the tokens are transformers'."""
    mesh = Mesh(model_dir, workers=2, schedulers=2, extra_router=["--scheduler-choice", "round-robin"],
                extra_scheduler=["--kv-fetch", "always"], extra_worker=["--fault-kill-after-pages", "5"])
    try:
        mesh.wait_split()
        prefix = random_ids(640, seed=30)  # 40 pages
        *_, seeded = generate(mesh.addr, ids_request(prefix + [4, 5], 2))
        prompt, tokens, logprobs, finish = on_another_worker(mesh, prefix, seeded.worker_id, seed=300)
        assert finish.reason == gen.LENGTH and finish.worker_id != seeded.worker_id
        assert finish.transferred_prompt_tokens <= 5 * 16 and finish.cached_prompt_tokens == finish.transferred_prompt_tokens
        assert assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, prompt, 8)) >= 8
        source = next(c for c in mesh.children if c.name.startswith("worker") and c.process.poll() is not None)
        assert source.process.returncode == -9  # it did die (SIGKILL), mid-transfer
        # The fetching worker got every page back: those reserved for pages that never came too.
        pages = asyncio.run(wait_idle(mesh.kvcache_addr))
        survivor = [w for w in pages if w.worker_id == finish.worker_id]
        assert survivor and survivor[0].used_pages == 0, pages
    finally:
        mesh.close()


def test_a_worker_that_dies_while_it_fetches_a_prefix_hands_the_request_on_exactly(model_dir):
    """One scheduler over two workers (round-robin): the second request of a prefix lands on the
    worker that does not hold it, which fetches the pages from the first and SIGKILLs itself after
    writing 5 of them (TESTING ONLY flag). The request moves to the surviving worker, which holds
    the prefix: the stream is transformers' tokens, and that worker gets every page back."""
    mesh = Mesh(model_dir, workers=2, extra_scheduler=["--kv-fetch", "always", "--worker-choice", "round-robin"],
                extra_worker=["--fault-kill-after-fetched-pages", "5"])
    workers = [c for c in mesh.children if c.name.startswith("worker")]
    try:
        prefix = random_ids(640, seed=50)  # 40 pages
        *_, seeded = generate(mesh.addr, ids_request(prefix + [4, 5], 2))
        for attempt in range(4):  # round-robin: the next request goes to the other worker
            prompt = prefix + random_ids(9, seed=500 + attempt)
            tokens, logprobs, _, finish = generate(mesh.addr, ids_request(prompt, 8))
            if any(w.process.poll() is not None for w in workers):
                break
        else:
            raise AssertionError("no request was placed on the worker without the prefix")
        dead, = [w for w in workers if w.process.poll() is not None]
        assert dead.process.returncode == -9  # SIGKILL, mid-fetch
        assert finish.reason == gen.LENGTH and finish.worker_id == seeded.worker_id, finish
        assert finish.cached_prompt_tokens == 640 and finish.transferred_prompt_tokens == 0, finish
        assert assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, prompt, 8)) >= 8
        pages = asyncio.run(wait_idle(mesh.kvcache_addr))
        survivor = [w for w in pages if w.worker_id == seeded.worker_id]
        assert survivor and survivor[0].used_pages == 0, pages
    finally:
        mesh.close()


def test_pages_evicted_to_the_tier_are_read_back_instead_of_recomputed(model_dir):
    """One worker with a 1 MiB pool (4,096 tokens of the tiny model) and a 4 MiB tier: a prefix
    pushed out of the pool by other prompts is read back from the tier, exactly."""
    mesh = Mesh(model_dir, workers=1, extra_worker=["--kv-memory-mib", "1", "--kv-offload-mib", "4"],
                extra_scheduler=["--kv-fetch", "always"])
    try:
        prefix = random_ids(1008, seed=40)  # 63 pages
        *_, seeded = generate(mesh.addr, ids_request(prefix + [6], 2))
        for k in range(6):  # 6,000 other tokens through a pool of 4,096: the prefix's pages are evicted
            generate(mesh.addr, ids_request(random_ids(1000, seed=400 + k), 2))
        prompt = prefix + random_ids(5, seed=41)
        tokens, logprobs, _, finish = generate(mesh.addr, ids_request(prompt, 8))
        assert finish.transfer_source == "tier" and finish.transferred_prompt_tokens == 1008, finish
        assert finish.cached_prompt_tokens == 1008
        assert assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, prompt, 8)) >= 8
        worker = mesh.child("worker-0")
        assert scrape(worker.http, "kvmesh_kv_offload_bytes", worker=seeded.worker_id, kind="used") > 0
        assert scrape(worker.http, "kvmesh_kv_offload_bytes", worker=seeded.worker_id, kind="capacity") == 4 << 20
        sched = mesh.child("scheduler")
        assert scrape(sched.http, "kvmesh_prefix_cache_hits_by_source_total", model_name="default",
                      worker=seeded.worker_id, source="tier") >= 1008
    finally:
        mesh.close()
