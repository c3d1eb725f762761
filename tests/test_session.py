"""`Scheduler/Session`: a router's Submit calls over one stream, tokens batched per step.

Sent straight to a real scheduler (one worker, loopback gRPC, a real redis-server): calls over
one session stream exactly what transformers gives, in fewer messages than tokens; each call
ends with the status its Submit call would have (a bad request, a deadline, a cancel), beside
calls that go on; a router falls back to Submit calls for a scheduler without Session.
"""

import asyncio
import signal
import time

import grpc
import pytest

from kvmesh.services.router.session import SchedulerLink
from kvmesh.tokenizer import Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from local_mesh import LONG_KV, LONG_REQUEST, Mesh, queue_state, wait_idle
from reference import assert_matches_reference, hf_greedy

TOKENS = 24


@pytest.fixture(scope="module")
def mesh(long_model_dir):
    m = Mesh(long_model_dir, workers=1, extra_worker=LONG_KV)
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompts(long_model_dir):
    tok = Tokenizer.from_dir(long_model_dir)
    return [tok.encode(f"session call {i} reads the river's long story") for i in range(6)]


def submit(prompt_ids, max_new_tokens=TOKENS, request_id=""):
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                       sampling=gen.SamplingParams(temperature=0.0, seed=1),
                                       stopping=gen.StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True))


class Session:
    """A raw Session call: send SessionRequests, read its batches."""

    def __init__(self, channel):
        self.outgoing = asyncio.Queue()
        self.call = scheduler_pb2_grpc.SchedulerStub(channel).Session(self._requests(), timeout=120)
        self.messages = 0

    async def _requests(self):
        while (request := await self.outgoing.get()) is not None:
            yield request

    def send(self, call_id, **fields):
        self.outgoing.put_nowait(scheduler_pb2.SessionRequest(call_id=call_id, **fields))

    async def read_until(self, done):
        """Reads batches into {call_id: [SessionEvent]} until `done(calls)` holds."""
        calls = {}
        while not done(calls):
            batch = await self.call.read()
            assert batch is not grpc.aio.EOF, "the session ended early"
            self.messages += 1
            for entry in batch.events:
                calls.setdefault(entry.call_id, []).append(entry)
        return calls


def ended(calls, call_id):
    return any(e.end for e in calls.get(call_id, ()))


def tokens_of(entries):
    return [t for e in entries for t in e.event.token_ids], [lp for e in entries for lp in e.event.logprobs]


def test_calls_over_one_session_stream_exactly_in_fewer_messages_than_tokens(mesh, long_model_dir, prompts):
    async def run():
        async with grpc.aio.insecure_channel(mesh.child("scheduler").address) as channel:
            session = Session(channel)
            for i, prompt in enumerate(prompts, start=1):
                session.send(i, submit=submit(prompt), timeout_s=120)
            calls = await session.read_until(lambda c: all(ended(c, i) for i in range(1, len(prompts) + 1)))
            session.outgoing.put_nowait(None)
            assert await session.call.read() is grpc.aio.EOF  # every call ended and the caller is done: it ends
            return calls, session.messages

    calls, messages = asyncio.run(run())
    compared = total = 0
    for i, prompt in enumerate(prompts, start=1):
        last = calls[i][-1]
        assert last.end and last.code == grpc.StatusCode.OK.value[0], last
        finishes = [e.event for e in calls[i] if e.event.finish_reason != gen.FINISH_REASON_UNSPECIFIED]
        assert len(finishes) == 1 and finishes[0].finish_reason == gen.LENGTH
        tokens, logprobs = tokens_of(calls[i])
        total += len(tokens)
        compared += assert_matches_reference(tokens, logprobs, hf_greedy(long_model_dir, prompt, TOKENS))
    assert total == len(prompts) * TOKENS
    assert compared >= total // 2, f"only {compared} of {total} tokens compared"
    # Six calls decoding side by side: one message per step for all of them, not one per token.
    assert messages <= total // 2, f"{messages} messages for {total} tokens"


def test_each_session_call_ends_as_its_submit_call_would_and_the_others_go_on(mesh, long_model_dir, prompts):
    async def run():
        async with grpc.aio.insecure_channel(mesh.child("scheduler").address) as channel:
            session = Session(channel)
            session.send(1, submit=submit(prompts[0], LONG_REQUEST), timeout_s=120)  # to be cancelled
            first = await session.read_until(lambda c: c.get(1))
            session.send(2, submit=submit([5, 6, 999_999]))  # outside the vocabulary
            session.send(3, submit=submit(prompts[2], LONG_REQUEST), timeout_s=1.0)  # runs past its deadline
            session.send(4, submit=submit(prompts[3]), timeout_s=120)  # an ordinary call beside them
            calls = await session.read_until(lambda c: c.get(2) and ended(c, 3) and ended(c, 4))
            session.send(1, cancel=True)
            busy = await queue_state(mesh.redis_url, lambda n: n == 0, timeout=60)
            pages = await wait_idle(mesh.kvcache_addr, timeout=60, workers=1)
            session.outgoing.put_nowait(None)
            # The stream ends (without an error); what came after the cancel is call 1's tokens already sent.
            late = []
            while (batch := await session.call.read()) is not grpc.aio.EOF:
                late += batch.events
            return first, calls, busy, pages, late

    first, calls, busy, pages, late = asyncio.run(run())
    assert all(e.call_id == 1 and not e.end for e in late), late
    [bad] = calls[2]
    assert bad.end and bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.details.startswith("prompt_token_ids: ") and "outside the vocabulary" in bad.details, bad.details
    assert not any(e.end for e in calls[1]), "the call to cancel ended before it was cancelled"
    assert calls[3][-1].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert len(tokens_of(calls[3])[0]) < LONG_REQUEST
    tokens, logprobs = tokens_of(calls[4])
    assert calls[4][-1].code == grpc.StatusCode.OK.value[0] and len(tokens) == TOKENS
    assert assert_matches_reference(tokens, logprobs, hf_greedy(long_model_dir, prompts[3], TOKENS)) >= TOKENS // 2
    assert tokens_of(first[1])[0], "the call to cancel was streaming"
    # The cancelled call and the expired one left nothing behind: no request, no page.
    assert busy == 0
    assert all(w.used_pages == 0 for w in pages), pages


def test_a_session_that_opens_a_call_id_twice_ends_invalid_argument_and_frees_its_calls(mesh, prompts):
    async def run():
        async with grpc.aio.insecure_channel(mesh.child("scheduler").address) as channel:
            session = Session(channel)
            session.send(1, submit=submit(prompts[0], LONG_REQUEST), timeout_s=120)
            await session.read_until(lambda c: c.get(1))
            session.send(1, submit=submit(prompts[1]))  # call 1 is open: no end could tell the two apart
            with pytest.raises(grpc.aio.AioRpcError) as broken:
                await session.read_until(lambda c: False)
            return broken.value, await queue_state(mesh.redis_url, lambda n: n == 0, timeout=60)

    broken, busy = asyncio.run(run())
    assert broken.code() == grpc.StatusCode.INVALID_ARGUMENT and broken.details().startswith("call_id: 1 ")
    assert busy == 0  # the session's open call ended with it


def test_a_resumable_call_whose_session_drops_is_held_for_attach_which_takes_it_over(mesh, prompts):
    async def run():
        async with grpc.aio.insecure_channel(mesh.child("scheduler").address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            first, second = Session(channel), Session(channel)
            # held-2 runs beside held-1 in the same batch, 2,000 steps to held-1's 300: it is still
            # running when held-1 is read to its end, whatever the machine's speed.
            for session, rid, prompt, n in ((first, "held-1", prompts[4], 300), (second, "held-2", prompts[5], 2000)):
                request = submit(prompt, n, request_id=rid)
                request.resumable = True
                session.send(1, submit=request, timeout_s=120)
                await session.read_until(lambda c: c.get(1))
            first.call.cancel()  # the router died: the session drops under the call
            attached = [e async for e in stub.Attach(scheduler_pb2.AttachRequest(
                request_id="held-1", prompt_token_ids=prompts[4]), timeout=120)]
            # A live session's call taken over by an Attach (its router had not noticed its client left).
            attach = stub.Attach(scheduler_pb2.AttachRequest(request_id="held-2", prompt_token_ids=prompts[5]), timeout=120)
            head = await attach.read()
            taken = await second.read_until(lambda c: ended(c, 1))
            rest = []
            while (event := await attach.read()) is not grpc.aio.EOF:
                rest.append(event)
            return attached, taken[1][-1], [head, *rest], await queue_state(mesh.redis_url, lambda n: n == 0, timeout=60)

    attached, taken, reattached, busy = asyncio.run(run())
    assert sum(len(e.token_ids) for e in attached) == 300 and attached[-1].finish_reason == gen.LENGTH
    assert taken.code == grpc.StatusCode.CANCELLED.value[0] and "attached" in taken.details
    assert sum(len(e.token_ids) for e in reattached) == 2000 and reattached[-1].finish_reason == gen.LENGTH
    assert busy == 0


class SubmitOnly(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler of a release before Session: Submit only (Session answers UNIMPLEMENTED)."""

    async def Submit(self, request, context):
        yield scheduler_pb2.TokenEvent(token_ids=list(request.prompt_token_ids)[::-1], logprobs=[0.0] * 3)
        yield scheduler_pb2.TokenEvent(finish_reason=gen.LENGTH, worker_id="old")


def with_submit_only_link(body):
    """`body(link)`'s result, for a SchedulerLink to a real gRPC server of SubmitOnly over loopback."""
    async def run():
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SubmitOnly(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await body(SchedulerLink(channel, f"127.0.0.1:{port}"))
        finally:
            await server.stop(0)

    return asyncio.run(run())


def test_a_router_link_to_a_scheduler_without_session_falls_back_to_submit_calls():
    async def body(link):
        with pytest.raises(grpc.aio.AioRpcError) as first:
            async for _ in link.Submit(submit([1, 2, 3]), timeout=30):
                pass
        events = [e async for e in link.Submit(submit([1, 2, 3]), timeout=30)]
        return first.value, link.legacy, events

    first, legacy, events = with_submit_only_link(body)
    # The call that met the missing Session ends UNAVAILABLE, which the router resubmits; the next goes as Submit.
    assert first.code() == grpc.StatusCode.UNAVAILABLE and "UNIMPLEMENTED" in first.details()
    assert legacy
    assert [list(e.token_ids) for e in events] == [[3, 2, 1], []] and events[-1].worker_id == "old"


def test_a_stopping_scheduler_refuses_new_session_calls_at_once_while_open_ones_run_on(long_model_dir, prompts):
    mesh = Mesh(long_model_dir, workers=1, extra_worker=LONG_KV)
    scheduler = mesh.child("scheduler")
    try:
        async def run():
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                session, idle = Session(channel), Session(channel)
                session.send(1, submit=submit(prompts[0], LONG_REQUEST), timeout_s=120)
                await session.read_until(lambda c: c.get(1))
                idle.send(1, submit=submit(prompts[1], 2), timeout_s=120)  # ends: the session is open, no call on it
                await idle.read_until(lambda c: ended(c, 1))
                scheduler.process.send_signal(signal.SIGTERM)  # a graceful stop: open calls get the grace period
                deadline = time.monotonic() + 60
                while await asyncio.to_thread(scheduler.serving):  # until its grace period began
                    assert time.monotonic() < deadline, "the scheduler never left SERVING after SIGTERM"
                    await asyncio.sleep(0.05)
                session.send(2, submit=submit(prompts[1]), timeout_s=120)
                calls = await session.read_until(lambda c: ended(c, 2))
                return calls, await idle.call.read(), await idle.call.code()
        calls, idle_read, idle_code = asyncio.run(run())
    finally:
        mesh.close()
    [refused] = calls[2]
    # As a new Submit call to a stopping server: UNAVAILABLE, which a router sends to another scheduler.
    assert refused.end and refused.code == grpc.StatusCode.UNAVAILABLE.value[0] and "stopping" in refused.details
    assert not refused.HasField("event")
    # A session with no call open ends at once, not at the end of the grace period, and cleanly.
    assert idle_read is grpc.aio.EOF and idle_code == grpc.StatusCode.OK


# -- the session's batching, on its own (no scheduler: a generator stands in for Submit) --------


async def drive_session(calls):
    """Runs serve_session over `calls` ({call_id: SubmitRequest}) with a Submit that streams
    max_new_tokens events of one token and 20 alternatives each, and reads every message after
    all of them were queued (a caller far behind). Returns the messages."""
    from kvmesh.services.scheduler.session import serve_session

    async def submit(request, context):
        if request.prompt_token_ids[0] == 0:  # one event over what a caller may receive
            yield scheduler_pb2.TokenEvent(top_ids=[7] * 1_000_000, top_logprobs=[-1.0] * 1_000_000)
        if request.prompt_token_ids[0] == 1:  # tokens, then its worker is lost
            yield scheduler_pb2.TokenEvent(token_ids=[11], logprobs=[-0.5])
            yield scheduler_pb2.TokenEvent(token_ids=[12], logprobs=[-0.5])
            yield scheduler_pb2.TokenEvent(finish_reason=gen.ERROR, worker_lost=True)
            return
        for i in range(request.stopping.max_new_tokens):
            yield scheduler_pb2.TokenEvent(token_ids=[i % 500], logprobs=[-0.5], top_ids=list(range(20)),
                                           top_logprobs=[-1.0] * 20)
        yield scheduler_pb2.TokenEvent(finish_reason=gen.LENGTH)

    async def requests():
        for call_id, request in calls.items():
            yield scheduler_pb2.SessionRequest(call_id=call_id, submit=request)

    return [batch async for batch in serve_session(requests(), submit)]


def test_a_session_splits_a_long_backlog_into_bounded_messages_in_order():
    from kvmesh.services.scheduler.session import MAX_BATCH_BYTES

    messages = asyncio.run(drive_session({1: submit([5], 20_000), 2: submit([6], 3)}))
    assert len(messages) > 1 and all(m.ByteSize() <= MAX_BATCH_BYTES for m in messages)
    entries = [e for m in messages for e in m.events]
    tokens = [t for e in entries if e.call_id == 1 for t in e.event.token_ids]
    assert tokens == [i % 500 for i in range(20_000)]  # every token once, in order, across the entries
    assert [e.end for e in entries if e.call_id == 1][-1] and sum(e.end for e in entries) == 2
    assert [t for e in entries if e.call_id == 2 for t in e.event.token_ids] == [0, 1, 2]


def test_a_session_call_whose_message_would_break_the_session_ends_alone():
    from kvmesh.services.scheduler.session import MAX_EVENT_BYTES

    messages = asyncio.run(drive_session({1: submit([0], 5), 2: submit([6], 5)}))
    entries = [e for m in messages for e in m.events]
    [huge] = [e for e in entries if e.call_id == 1]
    assert huge.end and huge.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and not huge.HasField("event")
    assert f"over the session's limit of {MAX_EVENT_BYTES}" in huge.details
    assert [t for e in entries if e.call_id == 2 for t in e.event.token_ids] == [0, 1, 2, 3, 4]
    assert all(m.ByteSize() < MAX_EVENT_BYTES for m in messages)


def test_a_request_too_large_for_a_session_goes_as_its_own_submit_call():
    from kvmesh.services.router.session import MAX_SESSION_SUBMIT_BYTES

    async def body(link):
        huge = submit([1, 2, 3] + [30_000] * (MAX_SESSION_SUBMIT_BYTES // 3))
        return [e async for e in link.Submit(huge, timeout=30)], link

    events, link = with_submit_only_link(body)
    # Served at once by Submit (a session call to this server would have ended UNAVAILABLE first).
    assert events[-1].worker_id == "old" and link._session is None and not link.legacy


def test_a_session_sends_the_tokens_before_a_lost_workers_finish_in_their_own_entry():
    messages = asyncio.run(drive_session({1: submit([1], 5)}))
    entries = [e for m in messages for e in m.events]
    # A router acts on worker_lost before reading the tokens of its message: they come first, apart.
    assert [list(e.event.token_ids) for e in entries if e.HasField("event")] == [[11, 12], []]
    assert not entries[0].event.worker_lost and entries[1].event.worker_lost and entries[-1].end


def test_a_session_call_whose_finish_was_not_sent_is_not_counted_delivered():
    from kvmesh.services.scheduler.session import serve_session

    seen = []

    async def submit(request, context):
        try:
            yield scheduler_pb2.TokenEvent(token_ids=[3], logprobs=[-0.5], finish_reason=gen.LENGTH)
        finally:
            seen.append(context.finish_unsent)  # what the Submit handler's cleanup reads (_relay)

    async def requests():
        yield scheduler_pb2.SessionRequest(call_id=1, submit=submit.__defaults__ or scheduler_pb2.SubmitRequest())
        await asyncio.Event().wait()  # the caller stays, sending nothing more

    async def run():
        session = serve_session(requests(), submit)
        await session.__anext__()  # the batch with the finish is handed over...
        await session.aclose()  # ...and the stream breaks before it is confirmed sent

    asyncio.run(run())
    assert seen == [True]


class _Unconnected:
    """What a SessionCall asks of its session when it ends: nothing here is sent anywhere."""

    def forget(self, call_id):
        pass

    def send(self, request):
        pass


def test_a_slow_readers_events_wait_in_the_router_merged_into_one_per_read():
    """Events that arrive for a call faster than its client reads them wait in the router merged
    into one (as the scheduler's Outbox merges them), not one object per token; a lost worker's
    event stays apart, after the tokens before it; the end comes after everything."""
    from kvmesh.services.router.session import SessionCall

    def tokens(*ids, **fields):
        return scheduler_pb2.SessionEvent(call_id=1, event=scheduler_pb2.TokenEvent(
            token_ids=list(ids), logprobs=[-0.5] * len(ids), **fields))

    async def run():
        call = SessionCall(_Unconnected(), 1, None)
        for i in range(100):
            call.deliver(tokens(i))
        assert len(call.pending) == 1
        first = await anext(call)
        assert list(first.token_ids) == list(range(100)) and len(first.logprobs) == 100
        call.deliver(tokens(100))
        call.deliver(tokens(101, finish_reason=gen.LENGTH))
        call.deliver(scheduler_pb2.SessionEvent(call_id=1, end=True, code=grpc.StatusCode.OK.value[0]))
        rest = [e async for e in call]
        assert [(list(e.token_ids), e.finish_reason) for e in rest] == [([100, 101], gen.LENGTH)]

        lost = SessionCall(_Unconnected(), 1, None)
        lost.deliver(tokens(7))
        lost.deliver(tokens(8))
        lost.deliver(tokens(worker_lost=True, worker_id="w0"))
        assert [(list(e.token_ids), e.worker_lost) for e in [await anext(lost), await anext(lost)]] == [
            ([7, 8], False), ([], True)]

    asyncio.run(run())


def test_a_slow_readers_merged_events_stay_under_a_mebibyte_each():
    """However far a reader falls behind, no waiting event grows past MAX_MERGED_BYTES (what the
    scheduler's Outbox allows an entry): the client's messages stay under gRPC's receive limit."""
    from kvmesh.services.router.session import MAX_MERGED_BYTES, SessionCall

    async def run():
        call = SessionCall(_Unconnected(), 1, None)
        for i in range(200_000):  # about 2 MB of tokens and logprobs
            call.deliver(scheduler_pb2.SessionEvent(call_id=1, event=scheduler_pb2.TokenEvent(
                token_ids=[i % 32000], logprobs=[-0.5])))
        events = list(call.pending)
        assert 2 <= len(events) <= 4 and all(e.ByteSize() <= MAX_MERGED_BYTES for e in events)
        assert [t for e in events for t in e.token_ids] == [i % 32000 for i in range(200_000)]

    asyncio.run(run())
