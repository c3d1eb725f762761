"""What every service's gRPC server has: grpc.health.v1 (NOT_SERVING until ready), reflection
(grpc.reflection.v1 and v1alpha), and INVALID_ARGUMENT (not UNKNOWN) for a request whose bytes
are not the method's message."""

from __future__ import annotations

import asyncio
import errno
import inspect
import io
import logging
import os
import signal
import socket
from contextlib import aclosing
from typing import Callable, Coroutine

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from kvmesh.telemetry import shutdown_tracing

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
SETTLE_S = 10.0  # how long a stopped service's leftover tasks and threads get to end
# Calls gRPC core has accepted and the service has not picked up yet. Past grpc's default (1,000)
# it refuses new calls at random, and the caller sees CANCELLED with nothing said: a burst of
# 2,000 Generate streams from one client lost about 190 that way before the router's admission
# could answer them (RESOURCE_EXHAUSTED with a retry hint). Up to the soft limit every call
# reaches the service; between it and the hard limit grpc refuses a growing share (a flood).
PENDING_CALLS_SOFT, PENDING_CALLS_HARD = 10_000, 20_000

log = logging.getLogger(__name__)


def _register_reflection_v1() -> None:
    """Puts grpc/reflection/v1/reflection.proto in the default descriptor pool, so reflection can
    describe itself. grpcio-reflection ships only v1alpha; v1 is the same file in another package
    (same messages, same field numbers), so it is made from v1alpha's descriptor."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in proto.message_type:
        for f in message.field:
            if f.type_name:  # set only on message fields
                f.type_name = f.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type, method.output_type = method.input_type.replace(old, new), method.output_type.replace(old, new)
    pool.Add(proto)


def enable_reflection(service_names: list[str], server: grpc.aio.Server) -> None:
    """Server reflection under grpc.reflection.v1 (what grpcurl and current clients ask first) and
    v1alpha: one servicer behind both, since the two protocols are the same on the wire."""
    _register_reflection_v1()
    servicer = reflection.aio.ReflectionServicer([*service_names, reflection.SERVICE_NAME, REFLECTION_V1])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)  # v1alpha
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),))


class ServiceServer:
    """A grpc.aio server with health and reflection; `port` is the bound port (0 picks one).
    With `credentials` it listens with TLS (kvmesh.services.tls: mTLS inside the mesh), else plaintext.
    A message over `max_message_bytes` (default gRPC's 4 MiB) is refused with RESOURCE_EXHAUSTED."""

    def __init__(self, service_names: list[str], add_servicers: Callable[[grpc.aio.Server], None], host: str, port: int,
                 credentials: grpc.ServerCredentials | None = None, max_message_bytes: int | None = None):
        options = [("grpc.so_reuseport", 0), ("grpc.server.max_pending_requests", PENDING_CALLS_SOFT),
                   ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_HARD)]
        if max_message_bytes is not None:
            options.append(("grpc.max_receive_message_length", max_message_bytes))
        self.server = grpc.aio.server(options=options, interceptors=[UndecodableIsInvalidArgument()])
        add_servicers(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        self.stopping = asyncio.Event()  # set when stop() begins: calls in flight get their grace period
        enable_reflection([*service_names, health.SERVICE_NAME], self.server)
        address = f"{host}:{port}"
        try:
            self.port = (self.server.add_secure_port(address, credentials) if credentials
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # grpc's "Failed to bind"
            self.port = 0
        if self.port == 0:
            raise OSError(errno.EADDRINUSE, f"cannot serve gRPC on {host}:{port} (--port): the address is in use or not local")

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(False)

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        self.stopping.set()  # a service may refuse new work over open streams meanwhile
        await self.set_serving(False)
        await self.server.stop(grace)


class _Undecodable:
    """What a method's deserializer gives for bytes that do not parse, for the handler to refuse."""

    def __init__(self, error: Exception):
        self.error = error

    async def refuse(self, context) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not decode: {self.error}")


class UndecodableIsInvalidArgument(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT for a request message that does not decode (grpc.aio would answer
    UNKNOWN): the deserializer hands such bytes on as `_Undecodable` and the handler refuses them
    before the servicer sees them; a stream's bad message ends the stream the same way."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def lenient(raw: bytes):
            try:
                return parse(raw)
            except DecodeError as e:
                return _Undecodable(e)

        kind = ("stream_" if handler.request_streaming else "unary_") + ("stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous servicer: left as grpc runs it
        checked = _checked_stream(behavior) if handler.request_streaming else _checked_unary(behavior)
        return handler._replace(request_deserializer=lenient, **{kind: checked})


def _checked_unary(behavior):
    if inspect.isasyncgenfunction(behavior):
        async def relay(request, context):
            if isinstance(request, _Undecodable):
                await request.refuse(context)
            async with aclosing(behavior(request, context)) as responses:  # closed at once when the client leaves
                async for response in responses:
                    yield response
        return relay

    async def call(request, context):
        if isinstance(request, _Undecodable):
            await request.refuse(context)
        return await behavior(request, context)
    return call


def _checked_stream(behavior):
    async def checked(requests, context):
        async for request in requests:
            if isinstance(request, _Undecodable):
                await request.refuse(context)
            yield request

    if inspect.isasyncgenfunction(behavior):
        async def relay(requests, context):
            async with aclosing(behavior(checked(requests, context), context)) as responses:
                async for response in responses:
                    yield response
        return relay

    async def call(requests, context):
        return await behavior(checked(requests, context), context)
    return call


def run_service(main: Coroutine, settle_s: float = SETTLE_S):
    """Runs a service's `serve` coroutine as asyncio.run does, except that its end is bounded.
    asyncio.run cancels the tasks still running once `main` returned and waits for them, and for
    the default executor's threads, without limit: one task that does not end when cancelled keeps
    a stopped service alive for good. Here they get `settle_s` (each); what outlasts it is logged
    (each task with its stack) and the process exits at once with status 1."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in left:
            task.cancel()
        ended, stuck = loop.run_until_complete(asyncio.wait(left, timeout=settle_s)) if left else (set(), set())
        for task in ended:  # as asyncio.run reports them
            if not task.cancelled() and task.exception() is not None:
                loop.call_exception_handler({"message": "unhandled exception while stopping", "exception": task.exception(),
                                             "task": task})
        for task in stuck:
            stack = io.StringIO()
            task.print_stack(file=stack)
            log.error("stopping: task %s did not end within %.0f s of its cancellation:\n%s",
                      task.get_name(), settle_s, stack.getvalue())
        settled = not stuck and all(_ended_in_time(loop, step(), settle_s, what) for step, what in (
            (loop.shutdown_asyncgens, "closing async generators"),
            (loop.shutdown_default_executor, "threads of the default executor")))
        if not settled:
            logging.shutdown()
            os._exit(1)  # what is stuck would hang the interpreter's exit as well (it joins those threads)
        asyncio.set_event_loop(None)
        loop.close()


def _ended_in_time(loop, awaitable, timeout: float, what: str) -> bool:
    try:
        loop.run_until_complete(asyncio.wait_for(awaitable, timeout))
        return True
    except TimeoutError:
        log.error("stopping: %s still ran %.0f s later", what, timeout)
        return False


async def wait_for_termination(stop: Callable[[], "asyncio.Future | None"]) -> None:
    """Runs until SIGINT or SIGTERM, then awaits `stop()`."""
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await stop()


def advertised_address(common, port: int) -> str:
    """host:port that other services use: --advertise-host, else the listen host, else the hostname."""
    host = common.advertise_host or (common.host if common.host not in ("0.0.0.0", "::", "") else socket.gethostname())
    return f"{host}:{port}"


async def serve_until_stopped(server: ServiceServer, registry, kind: str, instance_id: str, record: dict,
                              *, tasks: tuple = (), serving: bool = True, cleanups: tuple = (), grace: float = 2.0,
                              drains: tuple = ()) -> None:
    """Registers the service's lease, turns SERVING (unless the service decides readiness itself),
    runs until SIGINT or SIGTERM, then stops background tasks and the lease, stops the server
    (calls in flight get `grace` seconds) while the `drains` (async callables: other ports' own
    graceful stops) run beside it, runs the `cleanups` (async callables), closes the registry
    and flushes queued spans."""
    await registry.register(kind, instance_id, {"pid": os.getpid(), **record})
    if serving:
        await server.set_serving(True)

    async def stop():
        for task in tasks:
            task.cancel()
        await registry.deregister(kind, instance_id)
        await asyncio.gather(server.stop(grace), *(drain() for drain in drains))
        for cleanup in cleanups:
            await cleanup()
        await registry.close()
        shutdown_tracing()

    await wait_for_termination(stop)
