"""The router: the public `kvmesh.v1.Generation` API.

It validates requests (one rule, one message: `kvmesh.params`), tokenizes, picks a scheduler
from the registry, relays token ids back as text (incremental detokenization, stop strings),
and ends every stream with a `finish` carrying reason, usage and timings. Only the router sees text.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from pathlib import Path

import grpc

from kvmesh.params import InvalidRequest, validate_request
from kvmesh.services import wire
from kvmesh.services.config import CommonConfig, RouterConfig
from kvmesh.services.grpc_server import ServiceServer, advertised_address, serve_until_stopped
from kvmesh.services.registry import Registry
from kvmesh.services.router.stops import StopStringMatcher
from kvmesh.services.worker.checkpoint import ModelConfig, load_config
from kvmesh.tokenizer import IncrementalDetokenizer, Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("kvmesh.router")
MAX_STOP_STRINGS = 16


class RouterService(generation_pb2_grpc.GenerationServicer):
    """Generate, ListModels, Tokenize. Errors: INVALID_ARGUMENT naming the field and the limit,
    NOT_FOUND for an unknown model, UNAVAILABLE while no scheduler or worker is ready; a
    scheduler's error status is passed on as it came."""

    def __init__(self, cfg: RouterConfig, model_dir: Path, registry: Registry):
        self.cfg = cfg
        self.model: ModelConfig = load_config(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.registry = registry
        self.schedulers: list[scheduler_pb2_grpc.SchedulerStub] = []
        self.scheduler_addresses: list[str] = []
        self.ready_workers = 0
        self._round_robin = itertools.count()
        self._seeds = random.Random()

    async def discover(self, on_ready) -> None:
        channels: dict[str, grpc.aio.Channel] = {}
        while True:
            try:
                records = await self.registry.services("scheduler")
                self.ready_workers = len(await self.registry.services("worker"))
                addresses = [r["address"] for r in records]
                for a in addresses:
                    channels.setdefault(a, grpc.aio.insecure_channel(a))
                self.scheduler_addresses = addresses
                self.schedulers = [scheduler_pb2_grpc.SchedulerStub(channels[a]) for a in addresses]
                await on_ready(bool(self.schedulers) and self.ready_workers > 0)
            except Exception as e:
                log.warning("discovery failed: %s", e)
            await asyncio.sleep(0.5)

    def _check_model(self, name: str) -> str | None:
        if name and name != self.cfg.model_name:
            return f"model {name!r} is not served here (served: {self.cfg.model_name!r})"
        return None

    def _prompt_ids(self, request) -> list[int]:
        if request.WhichOneof("input") == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        return self.tokenizer.encode(request.prompt) if request.prompt else []

    def _validated(self, request) -> scheduler_pb2.SubmitRequest:
        ids = self._prompt_ids(request)
        sampling = wire.sampling_from_proto(request.sampling)
        stopping = wire.stopping_from_proto(request.stopping)
        validate_request(ids, sampling, stopping, max_context=self.model.max_position_embeddings,
                         vocab_size=self.model.vocab_size)
        if len(request.stopping.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"has {len(request.stopping.stop)} strings, over the limit of {MAX_STOP_STRINGS}")
        submit = scheduler_pb2.SubmitRequest(
            request_id=request.request_id or uuid.uuid4().hex, prompt_token_ids=ids,
            sampling=request.sampling, stopping=wire.stopping_to_proto(stopping), priority=request.priority)
        if not submit.sampling.HasField("seed"):
            submit.sampling.seed = self._seeds.getrandbits(63)  # the stream stays reproducible on recompute
        return submit

    async def Generate(self, request, context):
        started = time.monotonic()
        if (problem := self._check_model(request.model)) is not None:
            await context.abort(grpc.StatusCode.NOT_FOUND, problem)
        try:
            submit = self._validated(request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.schedulers:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler is ready")
        stub = self.schedulers[next(self._round_robin) % len(self.schedulers)]
        remaining = context.time_remaining()
        call = stub.Submit(submit, timeout=remaining)
        detok = IncrementalDetokenizer(self.tokenizer, submit.prompt_token_ids)
        stops = StopStringMatcher(list(request.stopping.stop))
        completion, first_token_at = 0, None
        try:
            async for event in call:
                out = gen.GenerateResponse(request_id=submit.request_id)
                for token_id, logprob in zip(event.token_ids, event.logprobs):
                    completion += 1
                    first_token_at = first_token_at or time.monotonic()
                    text = stops.push(detok.push(token_id))
                    out.tokens.append(gen.Token(id=token_id, text=text, logprob=logprob))
                    if stops.stopped:
                        break
                reason = gen.STOP if stops.stopped else event.finish_reason
                if reason != gen.FINISH_REASON_UNSPECIFIED:
                    if not stops.stopped and out.tokens:
                        out.tokens[-1].text += stops.push(detok.flush()) + stops.flush()
                    now = time.monotonic()
                    out.finish.CopyFrom(gen.Finish(
                        reason=reason, prompt_tokens=len(submit.prompt_token_ids),
                        cached_prompt_tokens=event.cached_prompt_tokens, completion_tokens=completion,
                        queue_ms=event.queue_ms, ttft_ms=((first_token_at or now) - started) * 1000,
                        total_ms=(now - started) * 1000, message=event.message,
                        worker_id=event.worker_id, preemptions=event.preemptions))
                    yield out
                    return
                yield out
        except grpc.aio.AioRpcError as e:  # passed on as it came, retry hint included
            await context.abort(e.code(), e.details() or "scheduler error", tuple(e.trailing_metadata() or ()))
        finally:
            call.cancel()  # no-op once finished; frees the request upstream when the client left

    async def ListModels(self, request, context):
        models = []
        if self.ready_workers:
            models.append(gen.ModelInfo(name=self.cfg.model_name, ready_workers=self.ready_workers,
                                        max_context=self.model.max_position_embeddings))
        return gen.ListModelsResponse(models=models)

    async def Tokenize(self, request, context):
        if (problem := self._check_model(request.model)) is not None:
            await context.abort(grpc.StatusCode.NOT_FOUND, problem)
        return gen.TokenizeResponse(ids=self.tokenizer.encode(request.text))


async def serve(common: CommonConfig, cfg: RouterConfig) -> None:
    from kvmesh.modelgen import default_model_dir

    registry = Registry(common.redis_url)
    service = RouterService(cfg, Path(cfg.model) if cfg.model else default_model_dir(), registry)
    server = ServiceServer(["kvmesh.v1.Generation"], lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(service, s),
                           common.host, cfg.port)
    await server.start()
    address = advertised_address(common, server.port)
    ready = asyncio.Event()

    async def on_ready(is_ready: bool):
        await server.set_serving(is_ready)
        if is_ready and not ready.is_set():
            ready.set()
            print(f"router ready on {address}", flush=True)

    discovery = asyncio.create_task(service.discover(on_ready))
    await serve_until_stopped(server, registry, "router", address, {"address": address}, tasks=(discovery,), serving=False)
