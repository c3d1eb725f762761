"""The router's HTTP side (aiohttp, on the router's event loop): `/health` (alive), `/ready` (a model
pool has a ready worker), `/metrics` (Prometheus) and the OpenAI-compatible API under `/v1`.
Every error, also one no handler answers (an unknown path such as /v1/embeddings is 404, a wrong
method 405, an unexpected exception 500), has OpenAI's JSON shape."""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from kvmesh.services.router import openai_api

log = logging.getLogger("kvmesh.router")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own error answers (plain text) as OpenAI's JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = f"Invalid URL ({request.method} {request.path})" if e.status in (404, 405) else e.reason
        error = openai_api.ApiError(e.status, message, code="not_found" if e.status == 404 else None)
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}
        return error.response(allow)
    except Exception:  # a bug in a handler: the client still gets JSON, the log gets the traceback
        log.exception("%s %s failed", request.method, request.path)
        return openai_api.ApiError(500, "internal server error", "server_error").response({})


def build_app(service) -> web.Application:
    app = web.Application(client_max_size=service.cfg.max_request_bytes, middlewares=[openai_errors])

    async def health(_request):
        return web.json_response({"status": "alive"})

    async def ready(_request):
        if service.is_ready:
            return web.json_response({"status": "ready", "models": [p.name for p in service.pools.values() if p.ready]})
        return web.json_response({"status": "not ready", "reason": "no scheduler with a ready worker"}, status=503)

    async def metrics(_request):
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    openai_api.add_routes(app, service)
    return app


async def start_http(service, host: str, port: int, ssl_context=None,
                     drain_s: float = 30.0) -> tuple[web.AppRunner, int] | None:
    """Serves the app on host:port (0 picks a free port), over TLS with `ssl_context`; None when
    port is -1. The runner's cleanup closes the port and lets requests in flight finish for up to
    `drain_s` seconds."""
    if port < 0:
        return None
    runner = web.AppRunner(build_app(service), access_log=None, shutdown_timeout=drain_s,
                           handler_cancellation=True)  # a client that leaves cancels at once
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:
        raise OSError(e.errno, f"cannot serve HTTP on {host}:{port} (--http-port): {e.strerror}") from None
    bound = site._server.sockets[0].getsockname()[1]
    return runner, bound
