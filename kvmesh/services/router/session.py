"""The router's side of `Scheduler/Session`: Submit calls to one scheduler over one stream.

`SchedulerLink` stands where a `SchedulerStub` would: its `Submit` returns a `SessionCall`, which
reads as a Submit call does (async iteration of TokenEvents; an `AioRpcError` with the status,
details and trailing metadata the scheduler ended it with; `cancel()`), so the router's resume and
error handling are the same for both. The calls of a link share one Session stream, opened on the
first call and again after it broke; its batches are handed to the calls they are for. A
scheduler without Session (an older release) answers UNIMPLEMENTED: the link then uses plain
Submit calls (for LEGACY_RETRY_S, then it tries again), and the calls that were waiting on the
session end UNAVAILABLE, which the router resubmits. A request over MAX_SESSION_SUBMIT_BYTES is a
plain Submit call too: one over the scheduler's receive limit then fails alone instead of breaking
the session under every call on it.

When the stream breaks, every call on it ends UNAVAILABLE naming why, as a broken Submit call
does, and the router resumes them; the scheduler, for its part, treats them as dropped streams.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque

import grpc

from kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("kvmesh.router")

_CODES = {code.value[0]: code for code in grpc.StatusCode}
MAX_SESSION_SUBMIT_BYTES = 1 << 20  # larger requests (a prompt of some 300,000 tokens) are plain Submit calls
MAX_MERGED_BYTES = 1 << 20  # a slow reader's waiting tokens merge into events of this size at most, as the scheduler's
LEGACY_RETRY_S = 60.0  # a scheduler without Session is asked again after this long


def _error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class SessionCall:
    """One Submit call made over a session: reads as a grpc.aio stream call."""

    _END = object()

    def __init__(self, session: "_Session", call_id: int, timeout: float | None):
        self.session, self.call_id = session, call_id
        # Not yet read, in order: TokenEvents, then the end (_END or an AioRpcError), which stays.
        self.pending: deque = deque()
        self._last_bytes: int | None = None  # the last pending TokenEvent's size once a merge asked for it
        self._arrived = asyncio.Event()
        self.ended = False
        self.finished = False  # its finish came: it ends on its own, a cancel has nothing to stop
        # The scheduler ends the call at its deadline (it was sent); this ends it here all the same.
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expired) if timeout else None

    def __aiter__(self):
        return self

    async def __anext__(self) -> scheduler_pb2.TokenEvent:
        while not self.pending:
            self._arrived.clear()
            await self._arrived.wait()
        item = self.pending[0]
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return self.pending.popleft()

    def _put(self, item) -> None:
        self.pending.append(item)
        self._arrived.set()

    def deliver(self, entry: scheduler_pb2.SessionEvent) -> None:
        if entry.HasField("event"):
            event, last = entry.event, self.pending[-1] if self.pending else None
            # A reader behind (its client reads slowly) finds one event with every token since its
            # last read, as the scheduler's Outbox merges them, not an event per token held here.
            # A lost worker's event stays alone: the reader acts on it before reading its tokens.
            # Sizes are taken only then: a reader that keeps up costs the relay nothing more.
            merged = False
            if isinstance(last, scheduler_pb2.TokenEvent) and not last.worker_lost and not event.worker_lost:
                size = (self._last_bytes or last.ByteSize()) + event.ByteSize()
                if merged := size <= MAX_MERGED_BYTES:
                    last.MergeFrom(event)
                    self._last_bytes = size
            if not merged:
                self._put(event)
                self._last_bytes = None
            self.finished = self.finished or event.finish_reason != 0
        if entry.end:
            code = _CODES.get(entry.code, grpc.StatusCode.UNKNOWN)
            self._end(None if code == grpc.StatusCode.OK
                      else _error(code, entry.details, tuple(entry.trailing_metadata.items())))

    def _end(self, error: grpc.aio.AioRpcError | None) -> None:
        if self.ended:
            return
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
        self.session.forget(self.call_id)
        self._put(self._END if error is None else error)

    def _expired(self) -> None:
        self._end(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self) -> bool:
        """Ends the call (the scheduler cancels it, as a dropped Submit stream); False once it ended."""
        if self.ended:
            return False
        if not self.finished:
            self.session.send(scheduler_pb2.SessionRequest(call_id=self.call_id, cancel=True))
        self._end(_error(grpc.StatusCode.CANCELLED, "Locally cancelled"))
        return True


class _Session:
    """One Session stream and the calls open on it."""

    def __init__(self, link: "SchedulerLink"):
        self.link = link
        self.calls: dict[int, SessionCall] = {}
        self.closed = False  # the stream ended
        self.draining = False  # takes no new calls: the stream is closed once the last one ended
        self._ids = itertools.count(1)
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._call = link.stub.Session(self._requests())
        self._reader = asyncio.create_task(self._read())

    def send(self, request: scheduler_pb2.SessionRequest | None) -> None:
        if not self.closed:
            self._outgoing.put_nowait(request)

    def submit(self, request: scheduler_pb2.SubmitRequest, timeout: float | None, metadata) -> SessionCall:
        call = SessionCall(self, next(self._ids), timeout)
        self.calls[call.call_id] = call
        self.send(scheduler_pb2.SessionRequest(call_id=call.call_id, submit=request, timeout_s=timeout or 0,
                                               metadata={k: v for k, v in metadata if isinstance(v, str)}))
        return call

    def forget(self, call_id: int) -> None:
        self.calls.pop(call_id, None)
        if self.draining and not self.calls:
            self.send(None)  # the scheduler ends the stream

    def close(self) -> None:
        """No new calls: the stream ends once those open have ended."""
        self.draining = True
        if not self.calls:
            self.send(None)

    async def _requests(self):
        while (request := await self._outgoing.get()) is not None:
            yield request

    async def _read(self) -> None:
        why = "the scheduler ended the session"
        try:
            async for batch in self._call:
                for entry in batch.events:
                    if (call := self.calls.get(entry.call_id)) is not None:
                        call.deliver(entry)
        except grpc.aio.AioRpcError as e:
            why = f"its scheduler session broke ({e.code().name}: {e.details()})"
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # tried again later: it may be upgraded in place
                self.link.legacy_until = time.monotonic() + LEGACY_RETRY_S
                log.info("scheduler %s has no Session: a Submit call per request for %.0f s", self.link.address,
                         LEGACY_RETRY_S)
        except asyncio.CancelledError:
            why = "the router is stopping"
            raise
        finally:
            self.closed = True
            self._outgoing.put_nowait(None)  # ends the request iterator, which grpc no longer reads
            self._call.cancel()
            for call in list(self.calls.values()):
                call._end(_error(grpc.StatusCode.UNAVAILABLE, why))


class SchedulerLink:
    """A router's way to one scheduler, in place of its SchedulerStub: Submit over a shared
    Session stream (plain Submit calls for a scheduler without one), Attach as a plain call."""

    def __init__(self, channel: grpc.aio.Channel, address: str = ""):
        self.stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self.address = address
        self.legacy_until = 0.0  # until then (time.monotonic), plain Submit calls: the scheduler had no Session
        self.closed = False  # left the pool: calls still made through it are plain Submit calls
        self._session: _Session | None = None

    @property
    def legacy(self) -> bool:
        return time.monotonic() < self.legacy_until

    def Submit(self, request: scheduler_pb2.SubmitRequest, timeout: float | None = None, metadata=()):
        # A request near the scheduler's receive limit goes alone: over it, it would break the session.
        if self.closed or self.legacy or request.ByteSize() > MAX_SESSION_SUBMIT_BYTES:
            return self.stub.Submit(request, timeout=timeout, metadata=metadata)
        if self._session is None or self._session.closed or self._session.draining:
            self._session = _Session(self)
        return self._session.submit(request, timeout, metadata)

    def Attach(self, request: scheduler_pb2.AttachRequest, **kwargs):
        return self.stub.Attach(request, **kwargs)

    def close(self) -> None:
        """The scheduler left the pool: its session ends once the calls still on it have ended."""
        self.closed = True
        if self._session is not None:
            self._session.close()
