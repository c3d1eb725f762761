"""`Scheduler/Session`: many Submit calls over one stream, their tokens batched per step.

A Submit stream carries one gRPC message per token, and on a busy mesh those messages, not the
scheduling, are most of what the scheduler and the router spend per token: each costs both sides
a trip through grpc's completion queue and poller thread. A router therefore opens one Session
per scheduler and makes its calls over it. Each call runs the scheduler's own Submit handler,
unchanged, against a `CallContext` standing in for its gRPC context (deadline, trace metadata,
abort with a status and trailing metadata), so a call admits, refuses, streams, holds and
cancels exactly as a Submit call does. What it yields goes to the session's `Outbox`, which
merges each call's events until the session's writer takes them: the step's tokens of every call
leave in one message, and a caller that reads slowly gets fewer, fuller messages, not a backlog.

A call ends with an `end` entry carrying the status its Submit call would have ended with. The
caller cancelling it cancels its handler (a dropped Submit stream: a resumable request is held
for Attach); the session ending, however it ends, cancels every call still open the same way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import aclosing

import grpc

from kvmesh.v1 import scheduler_pb2

log = logging.getLogger("kvmesh.scheduler")

# A batch larger than this is split, and so is one call's backlog; a single event larger than it (a
# long prompt's logprobs) leaves alone. One over MAX_EVENT_BYTES would be over the caller's receive
# limit (gRPC's default, 4 MiB) and break the whole session: that call ends RESOURCE_EXHAUSTED
# instead, as its Submit call would have.
MAX_BATCH_BYTES = 1 << 20
MAX_EVENT_BYTES = (4 << 20) - (64 << 10)


class CallAborted(Exception):
    """A call's handler ended it with a status (what `context.abort` does to a gRPC call)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """What a Submit handler reads of its gRPC context, for a call made over a session."""

    def __init__(self, request: scheduler_pb2.SessionRequest):
        loop = asyncio.get_running_loop()
        self._metadata = tuple(request.metadata.items())
        # As gRPC's: none unset (0), and none past what a deadline can mean (NaN, inf, centuries).
        self.deadline = loop.time() + request.timeout_s if 0 < request.timeout_s < 1e9 else None
        self.trailing: tuple[tuple[str, str], ...] = ()
        # The call's finish is yielded but not sent yet: if the call ends now, it was not delivered.
        self.finish_unsent = False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - asyncio.get_running_loop().time())

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise CallAborted(code, details)


class Outbox:
    """The session's events not yet sent: per call, its events since its last entry merged into
    one, up to MAX_BATCH_BYTES (a reader far behind gets several entries per call, in order)."""

    def __init__(self):
        self.entries: dict[int, scheduler_pb2.SessionEvent] = {}  # per call, the entry still taking events
        self.sizes: dict[int, int] = {}  # their sizes as merged so far
        self.closed: list[scheduler_pb2.SessionEvent] = []  # full entries, in the order they filled
        self.ready = asyncio.Event()
        self._flush: asyncio.Future | None = None  # done once what was added since the last take() is sent
        self._sending: asyncio.Future | None = None  # the last take()'s, done once its batches are sent

    def flushed(self) -> asyncio.Future:
        """Done when the writer has sent everything added so far (in the next take's batches)."""
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_future()
        return self._flush

    def sent(self) -> None:
        """The writer sent the last take's batches."""
        if self._sending is not None and not self._sending.done():
            self._sending.set_result(None)
        self._sending = None

    def _entry(self, call_id: int, adding: int, alone: bool = False) -> scheduler_pb2.SessionEvent:
        entry = self.entries.get(call_id)
        if entry is not None and (alone or self.sizes[call_id] + adding > MAX_BATCH_BYTES):
            self.closed.append(entry)  # before any later entry of the call: its order holds
            entry = None
        if entry is None:
            entry = self.entries[call_id] = scheduler_pb2.SessionEvent(call_id=call_id)
            self.sizes[call_id] = 0
        self.sizes[call_id] += adding
        self.ready.set()
        return entry

    def event(self, call_id: int, event: scheduler_pb2.TokenEvent, size: int) -> None:
        """`size`: event.ByteSize(), which the caller has already computed."""
        # Later events of a stream only add tokens (repeated fields) and, last, its finish (scalars).
        # A finish that says the worker was lost goes in an entry of its own: a router acts on it
        # before reading its message's tokens, and the tokens before it must reach the client.
        self._entry(call_id, size, alone=event.worker_lost).event.MergeFrom(event)

    def end(self, call_id: int, code: grpc.StatusCode, details: str = "", trailing=()) -> None:
        entry = self._entry(call_id, len(details) + 16)
        entry.end, entry.code, entry.details = True, code.value[0], details
        entry.trailing_metadata.update({k: v for k, v in trailing if isinstance(v, str)})

    @property
    def pending(self) -> bool:
        return bool(self.entries or self.closed)

    def take(self) -> list[scheduler_pb2.SessionEvents]:
        """Everything pending, as messages of MAX_BATCH_BYTES at most (one larger entry alone)."""
        pending = [*self.closed, *self.entries.values()]
        self.closed, self.entries, self.sizes = [], {}, {}
        self._sending, self._flush = self._flush, None
        self.ready.clear()
        batches: list[scheduler_pb2.SessionEvents] = []
        size = MAX_BATCH_BYTES + 1
        for entry in pending:
            n = entry.ByteSize()
            if size + n > MAX_BATCH_BYTES:
                batches.append(scheduler_pb2.SessionEvents())
                size = 0
            batches[-1].events.append(entry)
            size += n
        return batches


async def serve_session(requests, submit, stopping: asyncio.Event | None = None):
    """A Session call's messages: runs each call it opens through `submit` (the Submit handler:
    request, context -> its TokenEvents) and yields their events in batches. Ends once the caller
    stopped sending and every call ended; when it ends otherwise, every open call is cancelled.
    Once `stopping` is set (the server is in its grace period), a new call ends UNAVAILABLE at
    once, as a new Submit call would (the caller sends it to another scheduler), and the session
    ends as soon as it has no call open: an idle session does not hold the server's stop.
    CallAborted(INVALID_ARGUMENT) for a caller that opens a call_id already open: the session's
    own status (no end for that id could tell the two calls apart)."""
    stopping = stopping or asyncio.Event()
    outbox = Outbox()
    calls: dict[int, asyncio.Task] = {}
    cancelled: set[int] = set()  # calls the caller cancelled: they end without an `end`

    async def run(call_id: int, request: scheduler_pb2.SessionRequest) -> None:
        context = CallContext(request)
        try:
            async with asyncio.timeout_at(context.deadline):
                async with aclosing(submit(request.submit, context)) as events:
                    async for event in events:
                        if (size := event.ByteSize()) > MAX_EVENT_BYTES:  # a caller's receive limit: it would break the session
                            raise CallAborted(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                              f"a stream message of {size} bytes is over the session's limit of "
                                              f"{MAX_EVENT_BYTES} (prompt logprobs of a long prompt: ask for fewer)")
                        outbox.event(call_id, event, size)
                        if event.finish_reason:
                            # As a Submit stream's finish counts as delivered once grpc has sent it: the
                            # handler ends (and releases the request) only after the writer sent it.
                            context.finish_unsent = True
                            await outbox.flushed()
                            context.finish_unsent = False
            outbox.end(call_id, grpc.StatusCode.OK)
        except CallAborted as e:
            outbox.end(call_id, e.code, e.details, context.trailing)
        except TimeoutError:
            outbox.end(call_id, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except asyncio.CancelledError:
            if call_id in cancelled or session_ending:
                raise
            # Another caller attached to the request (Scheduler/Attach took its relay over): say so.
            outbox.end(call_id, grpc.StatusCode.CANCELLED, "the request was attached to by another caller")
        except Exception as e:  # a bug: the call fails as grpc fails a handler that raised
            log.exception("session call %d failed", call_id)
            outbox.end(call_id, grpc.StatusCode.UNKNOWN, f"Unexpected error in the scheduler: {type(e).__name__}")

    def forget(call_id: int, task: asyncio.Task) -> None:  # also for a task cancelled before it ran
        if calls.get(call_id) is task:
            del calls[call_id]
        cancelled.discard(call_id)
        outbox.ready.set()

    async def read() -> None:
        try:
            async for request in requests:
                action = request.WhichOneof("action")
                if action == "submit":
                    if request.call_id in calls:
                        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                                          f"call_id: {request.call_id} is already open in this session")
                    if stopping.is_set():
                        outbox.end(request.call_id, grpc.StatusCode.UNAVAILABLE, "the scheduler is stopping")
                        continue
                    task = calls[request.call_id] = asyncio.create_task(run(request.call_id, request))
                    task.add_done_callback(functools.partial(forget, request.call_id))
                elif action == "cancel" and (task := calls.get(request.call_id)) is not None:
                    cancelled.add(request.call_id)
                    task.cancel()  # its handler's cleanup runs as a dropped Submit stream's would
        finally:
            outbox.ready.set()

    async def wake_on_stop() -> None:
        await stopping.wait()
        outbox.ready.set()

    session_ending = False
    reader = asyncio.create_task(read())
    watcher = asyncio.create_task(wake_on_stop())
    try:
        while True:
            await outbox.ready.wait()
            for batch in outbox.take():
                yield batch
            outbox.sent()
            if reader.done():
                reader.result()  # the caller's stream broke or sent what does not decode: end with that
            if (reader.done() or stopping.is_set()) and not calls and not outbox.pending:
                return
    finally:
        session_ending = True
        watcher.cancel()
        reader.cancel()
        for task in calls.values():
            task.cancel()
        await asyncio.gather(reader, watcher, *calls.values(), return_exceptions=True)
