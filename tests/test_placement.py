"""KV-aware worker choice: prefix overlap against load, the balance guard, and ties."""

import asyncio
import contextlib

from kvmesh.services.scheduler.placement import PlacementConfig, WorkerView, choose_worker

CFG = PlacementConfig()


def test_the_worker_holding_the_prefix_wins_at_similar_load():
    views = [WorkerView("a", 0, 10, 0), WorkerView("b", 18, 14, 40)]
    assert choose_worker(19, views, CFG).worker_id == "b"


def test_a_worker_too_far_above_the_least_loaded_is_not_a_candidate():
    # b holds the prefix but carries 40 pages more work than a: past the 32-page slack.
    views = [WorkerView("a", 0, 0, 0), WorkerView("b", 18, 40, 40)]
    assert choose_worker(19, views, CFG).worker_id == "a"
    assert choose_worker(19, views, PlacementConfig(balance_slack_pages=64)).worker_id == "b"


def test_a_prefix_still_queued_on_a_worker_does_not_count_against_it_for_a_request_sharing_it():
    # b's 40 pages include the 18 of a prompt queued there that this request shares (a system
    # prompt sent just before it): it would compute them on a too, so b's load for it is 22, in
    # the slack. Were those pages cached already (no credit), a hot prefix spreads to a as above.
    assert choose_worker(19, [WorkerView("a", 0, 0, 0), WorkerView("b", 18, 40, 40, 18)], CFG).worker_id == "b"
    assert choose_worker(19, [WorkerView("a", 0, 0, 0), WorkerView("b", 18, 60, 40, 18)], CFG).worker_id == "a"


def test_a_worker_without_room_for_the_pages_it_lacks_counts_them_as_load():
    # b holds the 18-page prefix cached and has 40 pages of work more than a. A copy on a goes into
    # pages no request holds there (free, or cached and unreferenced): with 19 of those, a takes
    # it at no cost to its requests and the guard spreads the prefix, as above. With 10, the other
    # 9 would come from a's running requests: they count as a's load, so b (which lacks 1 page and
    # has room for it) keeps the prompt until it is more than 9 + 32 pages ahead.
    roomy, crowded = WorkerView("a", 0, 0, 0, 0, 19), WorkerView("a", 0, 0, 0, 0, 10)
    b = lambda load: WorkerView("b", 18, load, 40, 0, 100)  # noqa: E731
    assert choose_worker(19, [roomy, b(40)], CFG).worker_id == "a"
    assert choose_worker(19, [crowded, b(40)], CFG).worker_id == "b"
    assert choose_worker(19, [crowded, b(41)], CFG).worker_id == "b"
    assert choose_worker(19, [crowded, b(42)], CFG).worker_id == "a"
    # Room is counted against the pages a worker lacks: c holds 10 of the 18 and has room for the rest.
    c = WorkerView("c", 10, 0, 20, 0, 9)
    assert choose_worker(19, [crowded, c, b(40)], CFG).worker_id == "c"
    # Spilling, it goes to a worker with room before an idler one without: d has 10 pages of work.
    d = WorkerView("d", 0, 10, 20, 0, 19)
    assert choose_worker(19, [crowded, d, b(60)], CFG).worker_id == "d"


def test_the_guard_grows_with_load():
    # Lowest load 100: b may be up to 50 pages (balance_ratio 0.5) above it.
    views = [WorkerView("a", 0, 100, 0), WorkerView("b", 18, 145, 40)]
    assert choose_worker(19, views, CFG).worker_id == "b"


def test_ties_go_to_the_worker_holding_fewer_pages_then_by_id():
    assert choose_worker(4, [WorkerView("a", 0, 0, 30), WorkerView("b", 0, 0, 0)], CFG).worker_id == "b"
    assert choose_worker(4, [WorkerView("b", 0, 0, 0), WorkerView("a", 0, 0, 0)], CFG).worker_id == "a"


def test_unknown_policy_is_an_error_naming_the_setting():
    try:
        PlacementConfig(policy="random")
    except ValueError as e:
        assert "worker_choice" in str(e)
    else:
        raise AssertionError("accepted an unknown policy")


def worker_loop(num_pages: int = 4096):
    """A scheduler's loop for one worker (`num_pages` pages of 16 tokens), not connected to any."""
    from prometheus_client import CollectorRegistry

    from kvmesh.metrics import SchedulerMetrics
    from kvmesh.services.config import SchedulerServiceConfig
    from kvmesh.services.scheduler.worker_loop import WorkerLoop
    from kvmesh.v1 import worker_pb2

    return WorkerLoop({"id": "w", "address": "w:1"}, worker_pb2.WorkerInfo(num_pages=num_pages, page_size=16, max_context=4096),
                      SchedulerServiceConfig(), None, SchedulerMetrics(CollectorRegistry()))


def test_a_workers_queued_tokens_follow_submits_steps_and_cancels_without_summing_per_submit(monkeypatch):
    """Placement weighs each worker's queued tokens; they are summed once per step (or removal)
    and kept up by each submit in between: a burst of n submits costs O(n) estimates, not O(n^2)."""
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.request import Request
    from kvmesh.step import SampledToken, StepResult

    loop = worker_loop()
    estimates = 0
    estimate = loop.estimated_tokens

    def counted(r):
        nonlocal estimates
        estimates += 1
        return estimate(r)

    monkeypatch.setattr(loop, "estimated_tokens", counted)
    full = lambda: sum(estimate(r) for r in loop.core.requests.values())  # noqa: E731
    for i in range(200):
        req = Request(f"r{i}", [5] * (20 + i), SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=10 + i))
        loop.submit(req, [], 0)
        assert loop.queued_tokens() == full()
    assert estimates <= 2 * 200  # one per submit (and one first sum), where summing each time took 200 * 201 / 2
    before = loop.queued_tokens()
    for _ in range(3):  # steps: tokens computed and generated leave the queue
        plan = loop.core.schedule()
        loop.core.update(plan, StepResult([SampledToken(c.seq_id, 7, 0.0) for c in plan.scheduled
                                           if loop.core.requests[c.seq_id].num_computed_tokens + c.num_tokens
                                           >= loop.core.requests[c.seq_id].num_tokens]))
        loop._account(0.0, 0.0, 0.0, 0.0)
        assert loop.queued_tokens() == full()
    assert loop.queued_tokens() < before
    loop.done("r3", [], finished=False)  # a cancel
    assert "r3" not in loop.core.requests and loop.queued_tokens() == full()


def test_a_request_fetching_its_prefix_counts_in_its_workers_load_from_its_submit():
    """A request whose prompt pages are being fetched is queued only once they arrive, but it is
    the worker's work from its submit: a burst placed meanwhile sees it (its tokens past the
    fetched pages and its outputs), until it ends."""
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.request import Request
    from kvmesh.services.scheduler.worker_loop import Fetch

    async def run():
        loop, asked = worker_loop(), asyncio.Event()

        class Peer:  # a fetch that stays out
            async def FetchPages(self, request, timeout, metadata):
                asked.set()
                await asyncio.Event().wait()

        loop.stub = Peer()
        hashes = [bytes([i]) for i in range(8)]
        req = Request("r", [5] * (16 * 8 + 4), SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=10))
        assert loop.queued_tokens() == 0
        loop.submit(req, hashes, 8, fetch=Fetch("peer:1", "peer", 0, hashes))
        assert loop.queued_tokens() == 4 + 10
        await asked.wait()
        loop._load_epoch += 1  # summed again (as after a step): the same
        assert "r" not in loop.core.requests and loop.queued_tokens() == 4 + 10
        loop.done("r", hashes, finished=False)
        assert loop.queued_tokens() == 0

    asyncio.run(run())


def test_a_queued_prompts_pages_count_as_held_until_its_last_request_using_them_ends():
    """Placement counts the pages of prompts queued on a worker as held (they will be computed
    there); two requests sharing a prefix keep it until both have ended."""
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.request import Request

    loop = worker_loop()
    shared, a, b = [b"p0", b"p1"], [b"a2"], [b"b2", b"b3"]
    for rid, hashes in (("a", shared + a), ("b", shared + b)):
        loop.submit(Request(rid, [5] * 16 * len(hashes), SamplingParams(), StoppingParams(max_new_tokens=4)), hashes, 0)
    assert [loop.local_prefix_pages(h) for h in (shared + a, shared + b, [b"x"])] == [3, 4, 0]
    loop.done("a", shared + a, finished=False)
    assert [loop.local_prefix_pages(h) for h in (shared + a, shared + b)] == [2, 4]
    loop.done("b", shared + b, finished=False)
    assert loop.queued_hashes == {} and loop.local_prefix_pages(shared + b) == 0


def test_a_workers_room_is_its_pages_no_request_holds():
    """Placement's room for a copy of a prefix: free pages and cached ones no request holds
    (evicting those takes nothing a request needs); a running request's pages are not room."""
    loop = worker_loop(num_pages=64)
    tokens = list(range(100, 180))  # 5 full pages
    loop.pool.open("a", loop.pool.match_prefix(tokens))
    loop.pool.grow("a", len(tokens))
    loop.pool.commit("a", tokens, len(tokens))
    assert loop.view([]).room_pages == 59
    loop.pool.release("a")  # cached, unreferenced
    assert loop.view([]).room_pages == 64


@contextlib.asynccontextmanager
async def scheduler_beside(index):
    """A scheduler service (no workers yet) whose kvcache is the servicer `index`, over loopback gRPC."""
    import types

    import grpc

    from kvmesh.services.config import SchedulerServiceConfig
    from kvmesh.services.scheduler.server import SchedulerService
    from kvmesh.v1 import kvcache_pb2_grpc

    server = grpc.aio.server()
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(index, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            service = SchedulerService(SchedulerServiceConfig(), None, metrics=types.SimpleNamespace())
            service._kvcache_stub = kvcache_pb2_grpc.KVCacheStub(channel)
            yield service
    finally:
        await server.stop(0)


def test_kvcache_is_asked_for_a_prompts_pages_only_when_a_peer_worker_could_send_them():
    """A submit whose prompt the worker would compute asks kvcache's index which peer holds it
    (to fetch instead); with no other worker of the pool and version registered (one worker, the
    usual `kvmesh up`) nothing could be fetched, and the submit waits on no round trip."""
    from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc

    class Index(kvcache_pb2_grpc.KVCacheServicer):
        def __init__(self):
            self.lookups = []

        async def Lookup(self, request, context):
            self.lookups.append(len(request.hashes))
            return kvcache_pb2.LookupResponse()

    async def run():
        index = Index()
        async with scheduler_beside(index) as service:
            loop = worker_loop()
            service.workers = {"w": loop}
            service.worker_records = {"w": {"id": "w", "address": "w:1", "epoch": 1, "version": "v1"}}
            hashes = [bytes([i]) for i in range(8)]
            assert await service.peer_pages(loop, hashes) is None and index.lookups == []
            service.worker_records["w2"] = {"id": "w2", "address": "w2:1", "epoch": 1, "version": "v2"}
            assert await service.peer_pages(loop, hashes) is None and index.lookups == []  # another version's
            service.worker_records["w3"] = {"id": "w3", "address": "w3:1", "epoch": 1, "version": "v1"}
            holders = await service.peer_pages(loop, hashes)
            assert index.lookups == [8] and service.plan_fetch(loop, hashes, holders) is None  # asked; none holds it

    asyncio.run(run())


def test_a_burst_whose_lookups_are_answered_together_is_spread_as_if_submitted_one_by_one():
    """A submit whose prompt its chosen worker would compute asks kvcache which peer holds it, and
    other submits are placed while it waits. Four requests with four new prompts arrive at once at
    a scheduler with two idle workers, and kvcache answers only once all four have asked: each
    chooses again after the answer, seeing those queued before it, so the prompts go two to a
    worker (choosing once, before the lookups, put all four on the first worker: each saw both idle)."""
    from opentelemetry import trace
    from prometheus_client import CollectorRegistry

    from kvmesh.metrics import SchedulerMetrics
    from kvmesh.services.scheduler.worker_loop import WorkerLoop
    from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, worker_pb2

    burst = 4

    class Index(kvcache_pb2_grpc.KVCacheServicer):
        def __init__(self):
            self.asked, self.all_asked = 0, asyncio.Event()

        async def Lookup(self, request, context):
            self.asked += 1
            if self.asked == burst:
                self.all_asked.set()
            await self.all_asked.wait()
            return kvcache_pb2.LookupResponse()

    async def run():
        index = Index()
        async with scheduler_beside(index) as service:
            info = worker_pb2.WorkerInfo(num_pages=4096, page_size=16, max_context=4096, vocab_size=1000)
            metrics = SchedulerMetrics(CollectorRegistry())
            service.workers = {w: WorkerLoop({"id": w, "address": f"{w}:1"}, info, service.cfg, None, metrics) for w in "ab"}
            service.worker_records = {w: {"id": w, "address": f"{w}:1", "epoch": 1, "version": "v1"} for w in "ab"}
            prompts = [[100 * p + t % 90 for t in range(16 * 64)] for p in range(burst)]
            held = await asyncio.gather(*(service._admit(scheduler_pb2.SubmitRequest(
                request_id=f"r{p}", prompt_token_ids=prompt), None, trace.INVALID_SPAN)
                for p, prompt in enumerate(prompts)))
        assert index.asked == burst
        return sorted(h.worker.worker_id for h in held)

    assert asyncio.run(run()) == ["a", "a", "b", "b"]


def test_the_router_counts_the_prompt_pages_a_scheduler_has_no_room_for_as_its_load():
    """Among schedulers the guard reads each scheduler's room from the lookup (its best worker's
    pages no request holds, `by_scheduler`): A holds the prompt's 18 cached pages and has 40 pages of
    work more than B. B, with room for 10 of the 19 pages it lacks, counts the other 9 as load and
    is within the 32-page slack of A: A keeps the prompt. B with room for all 19, or one kvcache
    has not heard from (room unknown), takes it."""
    from kvmesh.services.router.prefix_routing import SchedulerChoice

    hashes = [bytes([i]) for i in range(19)]
    choice = SchedulerChoice(PlacementConfig(balance_slack_pages=32))
    choice.start("A", [b"own"], 16 * 40, 0)  # A's 40 pages of other work
    assert choice.choose(["A", "B"], hashes, {"A": 18}, 16, {"A": 0, "B": 10}) == ("A", 18)
    assert choice.choose(["A", "B"], hashes, {"A": 18}, 16, {"A": 0, "B": 19}) == ("B", 0)
    assert choice.choose(["A", "B"], hashes, {"A": 18}, 16, {"A": 0}) == ("B", 0)


def test_a_schedulers_prefix_and_room_for_the_router_are_one_workers():
    """The router sets a scheduler's prefix against the room of the worker holding it, not of its
    roomiest worker: A's worker holding 10 of the prompt's 19 pages has no room for the other 9
    (they would come from its running requests), and A has 30 pages of work more than B, which has
    room for all 19. Read as one worker, A counts the 9 as load and is past the 32-page slack: B
    takes the prompt. A's longest prefix beside its idle worker's room (the reading before) kept it
    on A. A scheduler's best worker is the one that would compute the fewest pages, counting again
    what it lacks beyond its room: a holder with room, or a roomy worker over a holder of little."""
    from kvmesh.services.router.prefix_routing import SchedulerChoice, by_scheduler

    hashes = [bytes([i]) for i in range(19)]
    held, room = by_scheduler([("A", 10, 0), ("A", 0, 40), ("B", 0, 19)], len(hashes))
    assert (held, room) == ({"A": 10, "B": 0}, {"A": 0, "B": 19})
    choice = SchedulerChoice(PlacementConfig(balance_slack_pages=32))
    choice.start("A", [b"own"], 16 * 30, 0)  # A's 30 pages of other work
    assert choice.choose(["A", "B"], hashes, held, 16, room) == ("B", 0)
    assert choice.choose(["A", "B"], hashes, {"A": 10}, 16, {"A": 40, "B": 19}) == ("A", 10)  # the old reading
    assert by_scheduler([("A", 10, 9), ("A", 0, 40)], 19) == ({"A": 10}, {"A": 9})
    assert by_scheduler([("A", 2, 0), ("A", 0, 40)], 19) == ({"A": 0}, {"A": 40})


def test_the_routers_in_flight_prefixes_lead_followers_and_leave_with_their_requests():
    """A router sends a prompt's followers to the scheduler it sent the prompt to while that
    request runs (before kvcache's index holds its pages), and forgets the prompt's pages when the
    last request using them ends: each end takes back its own pages, once."""
    from collections import Counter

    from kvmesh.services.router.prefix_routing import SchedulerChoice

    choice = SchedulerChoice()
    shared = [b"s0", b"s1"]
    a = choice.start("A", shared + [b"a2"], 48, 10)
    b = choice.start("A", shared + [b"b2"], 48, 10)
    assert choice.choose(["A", "B"], shared + [b"c2"], {}, 16) == ("A", 2)  # nothing indexed yet: in flight leads
    a.prefilled()
    assert choice.in_flight["A"].tokens == 48 + 10 + 10
    a.done()
    a.done()  # a second end takes nothing more
    assert choice.in_flight["A"].hashes == Counter({b"s0": 1, b"s1": 1, b"b2": 1})
    assert choice.in_flight["A"].tokens == 48 + 10
    b.done()
    assert "A" not in choice.in_flight
    assert choice.choose(["A", "B"], shared + [b"c2"], {}, 16)[1] == 0  # nothing of it in flight or indexed now

