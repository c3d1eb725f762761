"""A client of the public `kvmesh.v1.Generation` API whose stream survives its router.

A request that names its `request_id` keeps running on its scheduler for a grace period when its
stream drops (the router died, the connection broke). `generate` then sends the same request
again, to the next router it knows, with `resume_from` = the tokens it has received, and the
stream continues from there: the caller sees one stream, no gap, no repeat. `kvmesh generate`
and `kvmesh bench` use it; any gRPC client can do the same (see GenerateRequest.resume_from).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import grpc

from kvmesh.v1 import generation_pb2 as gen

# How a stream breaks when its router dies or the connection drops; anything else is an answer.
RECONNECT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                   grpc.StatusCode.UNKNOWN)
BACKOFF_S, BACKOFF_CAP_S = 0.1, 1.0


async def generate(stubs: list, request: gen.GenerateRequest, timeout: float | None = None,
                   reconnect_s: float = 30.0, metadata=None, on_reconnect=None):
    """Yields the GenerateResponse messages of `request` as one stream, over the GenerationStubs
    `stubs` (routers; the first is tried first). The request gets a request_id when it has none.
    When a stream that had answered breaks (RECONNECT_CODES), it reconnects to the next stub
    with resume_from set, with backoff, for at most `reconnect_s` after the break (and within
    `timeout`, the whole request's limit); then the last error is raised. `on_reconnect(error)`
    is called before each reconnect. A request with n > 1 is not reconnected (resume_from resumes
    one stream)."""
    if not request.request_id:
        request = _with(request, request_id=uuid.uuid4().hex)
    deadline = None if timeout is None else time.monotonic() + timeout
    received, turn, give_up, failures = 0, 0, None, 0
    resumed = False  # once broken, every later attempt is a resume, answered or not
    while True:
        attempt = _with(request, resume_from=received) if resumed else request
        left = None if deadline is None else deadline - time.monotonic()
        answered = False
        try:
            async for response in stubs[turn % len(stubs)].Generate(attempt, timeout=left, metadata=metadata):
                answered = True
                received += len(response.tokens)
                yield response
            return
        except grpc.aio.AioRpcError as e:
            if e.code() not in RECONNECT_CODES or not (answered or resumed) or request.n > 1:
                raise  # (resume_from resumes one stream: a request with n > 1 choices is not resumed)
            now = time.monotonic()
            if answered:
                give_up, failures = now + reconnect_s, 0
            delay = min(BACKOFF_CAP_S, BACKOFF_S * 2 ** failures) * (0.5 + random.random() / 2)
            if now + delay > min(give_up, deadline or give_up):
                raise
            if on_reconnect is not None:
                on_reconnect(e)
            resumed, turn, failures = True, turn + 1, failures + 1
            await asyncio.sleep(delay)


def _with(request: gen.GenerateRequest, **fields) -> gen.GenerateRequest:
    copy = gen.GenerateRequest()
    copy.CopyFrom(request)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy
