"""The router: the public `kvmesh.v1.Generation` API.

It validates requests (one rule, one message: `kvmesh.params`), tokenizes, picks a scheduler
from the registry, relays token ids back as text (incremental detokenization, stop strings),
and ends every stream with a `finish` carrying reason, usage and timings. Only the router sees text.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
import uuid

import grpc

from kvmesh import grammar, telemetry
from kvmesh.fleet.rollout import RolloutState, canary_percent
from kvmesh.metrics import RouterMetrics
from kvmesh.params import MAX_CHOICES, InvalidRequest, validate_request, validate_request_id
from kvmesh.services import wire
from kvmesh.services.config import CommonConfig, RouterConfig
from kvmesh.services.grpc_server import ServiceServer, advertised_address, serve_until_stopped
from kvmesh.services.kvcache.pages import prefix_hashes
from kvmesh.services.registry import Registry, kv_tokens, pool_of, ready_versions
from kvmesh.services.router.limits import Admission, KeyLimiter, KeyLimits, LimitExceeded
from kvmesh.services.router.output import ChoiceOutput, alternatives, prompt_tokens, send_now
from kvmesh.services.router.pools import Pool, parse_models, served_names
from kvmesh.services.router.prefix_routing import LOOKUP_TIMEOUT_S, SchedulerChoice, by_scheduler
from kvmesh.services.router.session import SchedulerLink
from kvmesh.services.scheduler.placement import PlacementConfig
from kvmesh.services.tls import MeshIdentity, RegisteredPeers, mesh_identity, public_server_credentials, public_ssl_context
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("kvmesh.router")
MAX_STOP_STRINGS = 16
# The stop-string matcher's work per token grows with the square of a string's length.
MAX_STOP_STRING_CHARS = 256
# Choice i of a seeded request draws with seed + i * this (mod 2^63): distinct, reproducible seeds.
CHOICE_SEED_STRIDE = 0x9E3779B97F4A7C15
# Every response message echoes the request id: a long one would multiply what a request costs.
# A scheduler call that broke this way lost its scheduler (or its connection to it): resubmit.
RESUMABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
RESUME_BACKOFF_S, RESUME_BACKOFF_CAP_S = 0.05, 1.0


class RouterError(Exception):
    """A request the router ends with a gRPC status (the HTTP API maps it to a status code)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple = (), field: str = ""):
        super().__init__(message)
        self.code, self.message, self.trailing, self.field = code, message, trailing, field


class _Lost(Exception):
    """A scheduler call that ended without the request's finish: it must be resubmitted.
    `heard`: the call had streamed events (the request was running there). `cause`: "worker"
    when the scheduler said the request's worker was lost, else "scheduler"."""

    def __init__(self, why: str, heard: bool, cause: str = "scheduler"):
        super().__init__(why)
        self.heard, self.cause = heard, cause


async def _events_of(call):
    """A scheduler call's events, to the finish. _Lost when the call breaks (RESUMABLE_CODES),
    ends without a finish, or ends because the request's worker was lost; other errors raise."""
    heard = False
    try:
        async for event in call:
            if event.worker_lost:
                raise _Lost(f"worker {event.worker_id or '?'} was lost ({event.message})", heard=True, cause="worker")
            heard = True
            yield event
            if event.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
                return
    except grpc.aio.AioRpcError as e:
        if e.code() not in RESUMABLE_CODES:
            raise
        raise _Lost(f"its scheduler call broke ({e.code().name}: {e.details()})", heard) from None
    raise _Lost("the scheduler ended the stream without a finish", heard)


class RouterService(generation_pb2_grpc.GenerationServicer):
    """Generate, ListModels, Tokenize. Errors: UNAUTHENTICATED without a configured API key,
    INVALID_ARGUMENT naming the field and the limit (also for a message that does not decode),
    RESOURCE_EXHAUSTED for a message over max_request_bytes and for a request over its key's limits
    (with the `retry-after` hint, limits.py), NOT_FOUND for an unknown model, UNAVAILABLE while no
    scheduler or worker is ready; a scheduler's error status is passed on as it came."""

    def __init__(self, cfg: RouterConfig, registry: Registry, limiter: KeyLimiter, metrics: RouterMetrics | None = None,
                 identity: MeshIdentity | None = None):
        self.cfg = cfg
        self.stopping = asyncio.Event()  # the server's: set when SIGTERM begins the drain
        self.schedulers = RegisteredPeers(identity, "scheduler")  # mTLS to them when the mesh has an identity
        self.kvcaches = RegisteredPeers(identity, "kvcache")
        self.kvcache: kvcache_pb2_grpc.KVCacheStub | None = None  # the prefix index to route by
        self.choice = SchedulerChoice(PlacementConfig(balance_ratio=cfg.route_balance_ratio,
                                                      balance_slack_pages=cfg.route_balance_slack_pages))
        self.keys = cfg.key_book()
        self.limiter = limiter
        self.metrics = metrics or RouterMetrics()
        self.tracer = telemetry.tracer("kvmesh.router")
        served = served_names(parse_models(cfg.model, cfg.model_name), cfg.served_model_name)
        self.pools: dict[str, Pool] = {name: Pool.load(name, folder, aliases) for name, folder, aliases in served}
        self.default_pool = next(iter(self.pools))
        self._by_name = {n: p for p in self.pools.values() for n in (p.name, *p.aliases)}
        for name in self.pools:
            self.metrics.start(name)
        self.metrics.start_keys(self.keys.ids())
        self.registry = registry
        self._seeds = random.Random()

    async def discover(self, on_ready) -> None:
        """Every half second: each pool's live schedulers (those that answered over the mesh's
        channel, so an entry from a peer without a certificate from the CA gets no traffic, and
        that own a worker), ready workers per version and rollout state. Without Redis, and until
        the registry settled after an outage, pools keep what was last read; rounds retry with backoff."""
        while True:
            delay = 0.5
            try:
                await self.registry.check_registration()
                if self.registry.settled():
                    await self._read_pools()
                await on_ready(self.is_ready)
            except Exception as e:
                delay = self.registry.outage.failed("discovery", e)
            await asyncio.sleep(delay)

    async def _read_pools(self) -> None:
        schedulers = await self.registry.services("scheduler")
        workers = await self.registry.services("worker")
        leases = await self.registry.worker_owners([w["id"] for w in workers])
        owners = {lease[0] for lease in leases.values()}
        if self.cfg.scheduler_choice == "kv":
            kv = await self.kvcaches.channels([r["address"] for r in await self.registry.services("kvcache")])
            self.kvcache = kvcache_pb2_grpc.KVCacheStub(kv[0][1]) if kv else None
        verified = dict(await self.schedulers.channels([r["address"] for r in schedulers]))
        for pool in self.pools.values():
            addresses = [r["address"] for r in schedulers if pool_of(r) == pool.name and r["address"] in verified]
            # A scheduler without a worker would answer UNAVAILABLE; with no owners known (schedulers
            # of an older release), every registered one.
            pool.set_schedulers([(a, verified[a]) for a in addresses if a in owners] or [(a, verified[a]) for a in addresses],
                                SchedulerLink)
            self.metrics.schedulers.labels(pool.name).set(len(pool.schedulers))
            pool.versions = ready_versions(workers, pool.name)
            pool.kv_tokens = kv_tokens(workers, pool.name)
            pool.page_size = next((int(w.get("page_size", 16)) for w in workers if pool_of(w) == pool.name), 0)
            pool.owners = {w["id"]: (leases[w["id"]][0], w.get("epoch")) for w in workers
                           if pool_of(w) == pool.name and w["id"] in leases}
            pool.rollout = await self._rollout(pool.name)

    @property
    def is_ready(self) -> bool:
        """Some pool has a scheduler and a ready worker (gRPC health SERVING, HTTP /ready)."""
        return any(p.ready for p in self.pools.values())

    async def _rollout(self, pool: str) -> RolloutState | None:
        """The pool's rollout state; a record this router cannot read counts as none (and is logged)."""
        stored = await self.registry.rollout(pool)
        try:
            return RolloutState.from_json(stored) if stored else None
        except (ValueError, TypeError) as e:
            log.warning("ignoring the rollout state of %s: %s", pool, e)
            return None

    def pool_for(self, name: str) -> Pool:
        """The pool clients call `name`, by its name or an alias ('' is the first one); RouterError(NOT_FOUND) if none."""
        pool = self._by_name.get(name or self.default_pool)
        if pool is None:
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"model {name!r} is not served here (served: {', '.join(repr(n) for n in self._by_name)})")
        return pool

    async def _ready_pool(self, pool: Pool, timeout: float | None) -> None:
        """Waits for the pool to have a scheduler and a ready worker: at most no_worker_wait_s, and
        answers UNAVAILABLE before the caller's deadline would pass."""
        wait = self.cfg.no_worker_wait_s if timeout is None else min(self.cfg.no_worker_wait_s, 0.8 * timeout)
        deadline = time.monotonic() + wait
        while not pool.ready:
            if time.monotonic() >= deadline:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"model {pool.name!r} has no ready worker (waited {wait:.1f}s)")
            await asyncio.sleep(0.1)

    async def tokenize(self, pool: Pool, text: str, field: str = "prompt") -> list[int]:
        """Ids of `text` (special-token strings become their tokens: the caller wrote the whole
        prompt). InvalidRequest naming `field` when `text` is over max_prompt_chars, checked first;
        the tokenizing itself runs in a thread, so other streams go on meanwhile."""
        self._check_prompt_chars(len(text), field)
        return await asyncio.to_thread(pool.tokenizer.encode, text) if text else []

    async def tokenize_chat(self, pool: Pool, messages: list[dict]) -> list[int]:
        """Ids of `messages` through the pool's chat template, user text kept from becoming control
        tokens (`Tokenizer.encode_chat`). Raises as `tokenize`, for `messages` (all their top-level
        strings together), and as `encode_chat` (InvalidRequest, ValueError)."""
        self._check_prompt_chars(sum(len(v) for m in messages if isinstance(m, dict) for v in m.values()
                                     if isinstance(v, str)), "messages")
        return await asyncio.to_thread(pool.tokenizer.encode_chat, messages)

    def _check_prompt_chars(self, chars: int, field: str) -> None:
        if chars > self.cfg.max_prompt_chars:
            raise InvalidRequest(field, f"has {chars} characters, over the router's limit of "
                                        f"{self.cfg.max_prompt_chars} (max_prompt_chars)")

    async def _prompt_ids(self, pool: Pool, request) -> list[int]:
        if request.WhichOneof("input") == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        return await self.tokenize(pool, request.prompt)

    async def _validated(self, pool: Pool, request) -> scheduler_pb2.SubmitRequest:
        # The cheap checks first: nothing is tokenized for a request refused anyway.
        validate_request_id(request.request_id)
        if len(request.stopping.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"has {len(request.stopping.stop)} strings, over the limit of {MAX_STOP_STRINGS}")
        if (longest := max(map(len, request.stopping.stop), default=0)) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest("stop", f"holds a string of {longest} characters, over the limit of {MAX_STOP_STRING_CHARS}")
        if request.n > MAX_CHOICES:
            raise InvalidRequest("n", f"must be in [1, {MAX_CHOICES}], got {request.n}")
        if request.n > 1:  # choice i runs as request_id.i
            validate_request_id(f"{request.request_id}.{request.n - 1}")
        ids = await self._prompt_ids(pool, request)
        sampling = wire.sampling_from_proto(request.sampling)
        stopping = wire.stopping_from_proto(request.stopping)
        validate_request(ids, sampling, stopping, max_context=pool.model.max_position_embeddings,
                         vocab_size=pool.model.vocab_size)
        if sampling.structured_output is not None:
            await asyncio.to_thread(grammar.check, sampling.structured_output)  # a large schema takes a while
        submit = scheduler_pb2.SubmitRequest(
            request_id=request.request_id or uuid.uuid4().hex, prompt_token_ids=ids,
            sampling=request.sampling, stopping=wire.stopping_to_proto(stopping), priority=request.priority)
        if not submit.sampling.HasField("seed"):
            submit.sampling.seed = self._seeds.getrandbits(63)  # the stream stays reproducible on recompute
        submit.version = pool.version_for(submit.request_id)
        return submit

    def check_api_key(self, authorization: str | None) -> KeyLimits | None:
        """The limits of the caller's key, None when no keys are configured; RouterError(UNAUTHENTICATED)
        when keys are configured and `authorization` is not `Bearer <one of them>`."""
        if not self.keys.enabled:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        limits = self.keys.find(key.strip()) if scheme.lower() == "bearer" else None
        if limits is None:
            raise RouterError(grpc.StatusCode.UNAUTHENTICATED,
                              "missing or wrong API key: send `authorization: Bearer <key>`")
        return limits

    async def watch_keys(self) -> None:
        """Reads the keys file again when it changes (checked every second) or on SIGHUP."""
        if not self.keys.path:
            return
        changed = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, changed.set)
        while True:
            try:
                await asyncio.wait_for(changed.wait(), timeout=1.0)
            except TimeoutError:
                pass
            if self.keys.reload(force=changed.is_set()):
                self.metrics.start_keys(self.keys.ids())
            changed.clear()

    async def _admit(self, key: KeyLimits | None, span: telemetry.Span) -> Admission | None:
        """Takes the request's place under its key's requests/s and in-flight limits."""
        if key is None:
            return None
        span.set_attribute("kvmesh.api_key_id", key.id)
        try:
            admission = await self.limiter.admit(key)
        except LimitExceeded as e:
            raise self._refused(key, e) from None
        self.metrics.key_requests.labels(key.id, "admitted").inc()
        return admission

    async def _take_prompt(self, admission: Admission | None, prompt_tokens: int) -> None:
        if admission is None:
            return
        try:
            await self.limiter.take_prompt(admission.key, prompt_tokens)
        except LimitExceeded as e:
            raise self._refused(admission.key, e) from None
        self.metrics.key_tokens.labels(admission.key.id).inc(prompt_tokens)

    def _refused(self, key: KeyLimits, e: LimitExceeded) -> RouterError:
        self.metrics.key_requests.labels(key.id, e.limit).inc()
        hint = wire.retry_hint(e.retry_after_s) if e.retry_after_s is not None else ()
        return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), hint)

    def open_span(self, metadata) -> telemetry.Span:
        """The request's `kvmesh.generate` span, a child of the caller's `traceparent` when there is one."""
        return self.tracer.start_span("kvmesh.generate", context=telemetry.context_from_metadata(metadata),
                                      kind=telemetry.SpanKind.SERVER)

    async def generate(self, request, timeout: float | None, span: telemetry.Span, key: KeyLimits | None = None,
                       resumable: bool = False):
        """Streams GenerateResponse messages for one request; the last one (per choice) carries `finish`.
        Raises RouterError for bad input (INVALID_ARGUMENT), an unknown model (NOT_FOUND), nothing
        ready (UNAVAILABLE), a request over `key`'s limits (RESOURCE_EXHAUSTED with a retry hint)
        and a scheduler's error status, passed on as it came (retry hint included). A choice whose
        scheduler or worker dies is resubmitted with the tokens already streamed (UNAVAILABLE when
        no scheduler takes it within resume_timeout_s). `resumable`: the client can resume the
        request by its request_id, so the scheduler holds it when the stream drops. Records the
        request's metrics and sets `span`'s attributes and status; the caller ends `span`."""
        started = time.monotonic()
        pool = self._by_name.get(request.model or self.default_pool)
        model = pool.name if pool is not None else "unknown"  # a label per served pool only: bounded
        self.metrics.in_flight.labels(model).inc()
        finishes, choices = 0, max(1, request.n)
        admission = None
        try:
            admission = await self._admit(key, span)
            async for out in self._generate(request, timeout, span, started, admission, resumable):
                finishes += out.HasField("finish")
                yield out
        except (GeneratorExit, asyncio.CancelledError):  # the caller closed the stream: its client left
            if finishes < choices:
                self.metrics.cancelled.labels(model).inc()
            raise
        except RouterError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:  # unknown names would grow the label set without bound
                self.metrics.failure.labels(model, e.code.name).inc()
            span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, f"{e.code.name}: {e.message}"))
            raise
        finally:
            self.metrics.in_flight.labels(model).dec()
            if admission is not None:
                await self.limiter.finish(admission)
                self.metrics.key_tokens.labels(admission.key.id).inc(admission.output_tokens)

    async def _generate(self, request, timeout, span, started, admission: Admission | None, resumable: bool):
        pool = self.pool_for(request.model)
        try:
            submit = await self._validated(pool, request)
            resume_from = request.resume_from if request.HasField("resume_from") else None
            if resume_from is not None and not request.request_id:
                raise InvalidRequest("resume_from", "needs the request_id of the stream to resume")
            if resume_from is not None and request.n > 1:
                raise InvalidRequest("resume_from", f"resumes one stream: n must be 1, got {request.n}")
        except InvalidRequest as e:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e), field=e.field) from None
        submit.resumable = resumable
        await self._take_prompt(admission, len(submit.prompt_token_ids))
        if not pool.ready:
            waited = time.monotonic()
            await self._ready_pool(pool, timeout)
            submit.version = pool.version_for(submit.request_id)
            timeout = None if timeout is None else timeout - (time.monotonic() - waited)
        span.set_attribute("kvmesh.model", pool.name)
        span.set_attribute("kvmesh.request_id", submit.request_id)
        span.set_attribute("kvmesh.prompt_tokens", len(submit.prompt_token_ids))
        span.set_attribute("kvmesh.max_new_tokens", submit.stopping.max_new_tokens)
        deadline = None if timeout is None else time.monotonic() + timeout
        # One scheduler for all choices: the first one's prompt pages serve the others.
        scheduler, routed = (None, None) if resume_from is not None else await self._route(pool, submit, max(1, request.n), span)
        merged = None
        try:
            choices = [self._choice(pool, scheduler, request, self._choice_submit(submit, i, request.sampling), i,
                                    resume_from, deadline, span, started, admission) for i in range(max(1, request.n))]
            merged = choices[0] if len(choices) == 1 else _after_first(choices)
            async for out in merged:
                if routed is not None and routed.prompt_tokens and out.tokens:
                    routed.prefilled()
                yield out
        finally:
            if merged is not None:
                await merged.aclose()  # at once: cancels what still runs upstream
            if routed is not None:
                routed.done()

    async def _route(self, pool: Pool, submit, choices: int, span):
        """(scheduler stub, what to call when the request ends) for a new request of `choices`
        completions: by prefix and load when the pool has several schedulers (prefix_routing.py)."""
        addresses = pool.live_schedulers()
        if self.cfg.scheduler_choice != "kv" or len(addresses) < 2 or not pool.page_size:
            return pool.next_scheduler(), None
        hashes = prefix_hashes(list(submit.prompt_token_ids), pool.page_size)
        held, room = await self._prefix_holders(pool, hashes, span) if hashes else ({}, {})
        address, prefix = self.choice.choose(addresses, hashes, held, pool.page_size, room)
        span.set_attributes({"kvmesh.scheduler": address, "kvmesh.routed_prefix_pages": prefix})
        prompt = max(1, len(submit.prompt_token_ids) - prefix * pool.page_size)
        return pool.scheduler_at(address), self.choice.start(address, hashes, prompt, choices * submit.stopping.max_new_tokens)

    async def _prefix_holders(self, pool: Pool, hashes: list[bytes], span) -> tuple[dict[str, int], dict[str, float]]:
        """Per scheduler address, from kvcache's prefix index: the leading pages of `hashes` held, at
        its live epoch, by the worker of it that would compute the fewest of the prompt's pages,
        and that worker's room (pages no request holds; `prefix_routing.by_scheduler`); ({}, {})
        when kvcache cannot answer in time."""
        if self.kvcache is None:
            self._lookup_outcome(pool, span, "unavailable")
            return {}, {}
        try:
            found = await self.kvcache.Lookup(kvcache_pb2.LookupRequest(hashes=hashes), timeout=LOOKUP_TIMEOUT_S,
                                              metadata=telemetry.metadata_with_context(span))
        except grpc.aio.AioRpcError as e:
            self._lookup_outcome(pool, span, "unavailable")
            log.debug("prefix lookup failed (%s): routing by load", e.code().name)
            return {}, {}
        workers, holding = [], set()
        for w in found.workers:
            owner, epoch = pool.owners.get(w.worker_id, (None, None))
            if owner is not None and epoch == w.epoch:
                workers.append((owner, w.pages, found.room_pages.get(w.worker_id, float("inf"))))
                holding.add(w.worker_id)
        for worker_id, pages in found.room_pages.items():
            if worker_id not in holding and (owner := pool.owners.get(worker_id, (None, None))[0]) is not None:
                workers.append((owner, 0, pages))
        self._lookup_outcome(pool, span, "hit" if holding else "miss")
        return by_scheduler(workers, len(hashes))

    def _lookup_outcome(self, pool: Pool, span, outcome: str) -> None:
        """Counted, and on the request's span: a trace shows whether kvcache answered in time."""
        self.metrics.prefix_lookups.labels(pool.name, outcome).inc()
        span.set_attribute("kvmesh.prefix_lookup", outcome)

    def _choice_submit(self, submit: scheduler_pb2.SubmitRequest, i: int, asked) -> scheduler_pb2.SubmitRequest:
        """Choice i's request: its own id and seed (derived from the request's seed when one was
        given, so the choices are distinct and reproducible); prompt logprobs with choice 0 only."""
        if i == 0:
            return submit
        choice = scheduler_pb2.SubmitRequest()
        choice.CopyFrom(submit)
        choice.request_id = f"{submit.request_id}.{i}"
        choice.sampling.seed = (asked.seed + i * CHOICE_SEED_STRIDE) % 2**63 if asked.HasField("seed") \
            else self._seeds.getrandbits(63)
        choice.sampling.ClearField("prompt_logprobs")
        return choice

    async def _choice(self, pool: Pool, scheduler, request, submit, index: int, resume_from: int | None,
                      deadline: float | None, span, started, admission: Admission | None):
        """One completion's stream: its scheduler request's token events, across every scheduler
        call `_events` makes for it, as GenerateResponses with text (`ChoiceOutput`). Under a stream
        interval, tokens wait in `out` until `send_now` says they go (or the finish, or an error,
        ends the stream)."""
        text = ChoiceOutput(pool.tokenizer, submit.prompt_token_ids, list(request.stopping.stop), resume_from or 0)
        k = submit.sampling.logprobs
        trace_id = telemetry.trace_id_hex(span)
        itl = self.metrics.itl.labels(pool.name)
        interval = max(self.cfg.stream_interval, request.stream_interval)  # a request may raise the router's, not lower it
        max_gap_s = self.cfg.stream_interval_max_gap_ms / 1000
        first_token_at, last_token_at = None, None
        out, sent = None, False
        try:
            async for event in self._events(pool, scheduler, submit, resume_from, deadline, span, text):
                if out is None:
                    out = gen.GenerateResponse(request_id=request.request_id or submit.request_id, index=index)
                if event.HasField("prompt"):
                    out.prompt_tokens.extend(prompt_tokens(pool.tokenizer, submit.prompt_token_ids, event.prompt,
                                                           submit.sampling.prompt_logprobs))
                    submit.sampling.ClearField("prompt_logprobs")  # sent: a resubmit must not ask again
                now = time.monotonic()
                gap = None if last_token_at is None else now - last_token_at
                for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs)):
                    token = text.token(token_id, logprob, alternatives(event.top_ids, event.top_logprobs, k, i) if k else ())
                    if token is not None:  # None: replayed for a resuming client that has it already
                        first_token_at = first_token_at or now
                        if last_token_at is not None:
                            itl.observe(now - last_token_at)
                        last_token_at = now
                        out.tokens.append(token)
                    if text.stopped:
                        break
                reason = gen.STOP if text.stopped else event.finish_reason
                if reason != gen.FINISH_REASON_UNSPECIFIED:
                    if len(text.token_ids) < text.skip:
                        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                          f"resume_from: {text.skip} is more than the {len(text.token_ids)} tokens "
                                          f"request {submit.request_id!r} produced", field="resume_from")
                    if out.tokens:
                        out.tokens[-1].text += text.finish()
                    finish = gen.Finish(
                        reason=reason, prompt_tokens=len(submit.prompt_token_ids),
                        cached_prompt_tokens=event.cached_prompt_tokens, completion_tokens=len(text.token_ids),
                        queue_ms=event.queue_ms, ttft_ms=((first_token_at or now) - started) * 1000,
                        total_ms=(now - started) * 1000, message=event.message, trace_id=trace_id,
                        worker_id=event.worker_id, preemptions=event.preemptions, model_version=event.version,
                        resumes=event.resumes, transferred_prompt_tokens=event.transferred_prompt_tokens,
                        transfer_source=event.transfer_source)
                    self._record_finish(pool.name, finish, submit.stopping.max_new_tokens, span)
                    out.finish.CopyFrom(finish)
                    yield out
                    return
                if out.prompt_tokens or send_now(len(out.tokens), sent, interval, gap, max_gap_s):
                    sent = True
                    yield out
                    out = None
        except RouterError:
            if out is not None and out.tokens:  # what the stream produced before the error is the client's
                yield out
            raise
        finally:
            if admission is not None:  # every choice's tokens sent on this stream count against the key
                admission.output_tokens += max(0, len(text.token_ids) - text.skip)

    async def _events(self, pool: Pool, scheduler, submit, resume_from: int | None, deadline: float | None, span,
                      output: ChoiceOutput):
        """The scheduler's TokenEvents for the request, to its last one, across every scheduler
        call it takes: an Attach to the scheduler holding it when the client resumes
        (`resume_from`), else a Submit; then, whenever the call breaks (UNAVAILABLE, CANCELLED: its
        scheduler died) or ends because its worker was lost, a Submit to a live scheduler of the
        pool with the tokens already streamed (`output`), retried with backoff for resume_timeout_s.
        RouterError for any other error status, and UNAVAILABLE when that time runs out or when the
        router is stopping (its drain waits for calls in flight, not for new ones it would start)."""
        call = await self._attach(submit, resume_from) if resume_from is not None else None
        failures, give_up, cause = 0, None, None
        while True:
            if call is None and (scheduler is not None or pool.schedulers):
                call = self._submit(scheduler or pool.next_scheduler(), submit, output, deadline, span)
                scheduler = None  # a resubmit goes to whichever live scheduler is next
            try:
                if call is None:
                    raise _Lost(f"pool {pool.name!r} has no live scheduler", heard=False)
                async for event in _events_of(call):
                    yield event
                return
            except _Lost as lost:
                why = str(lost)
                if lost.heard or cause is None:
                    cause = why  # what started these retries
                if lost.heard:  # it was running: this is a resume (a refused retry is not one)
                    submit.resumes += 1
                    self.metrics.resumes.labels(pool.name, lost.cause).inc()
                    failures, give_up = 0, None
                    log.warning("request %s: %s; resuming it after %d tokens", submit.request_id, why, len(output.token_ids))
            except grpc.aio.AioRpcError as e:
                if not (e.code() == grpc.StatusCode.NOT_FOUND and resume_from == 0 and not output.token_ids):
                    raise RouterError(e.code(), e.details() or "scheduler error", tuple(e.trailing_metadata() or ())) from None
                call, resume_from = None, None  # nothing held and nothing received: start it afresh
                continue
            finally:
                if call is not None:
                    call.cancel()  # no-op once finished; frees the request upstream when the client left
            call = None
            if self.stopping.is_set():  # a stopping router starts no new work (--drain-s)
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"request {submit.request_id!r}: {cause}, and this "
                                  f"router is stopping: resume it through another router")
            now = time.monotonic()
            give_up = give_up or now + self.cfg.resume_timeout_s
            delay = min(RESUME_BACKOFF_CAP_S, RESUME_BACKOFF_S * 2 ** failures) * (0.5 + random.random() / 2)
            failures += 1
            if now + delay > min(give_up, deadline or give_up):
                raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                  f"request {submit.request_id!r}: {cause}, and no scheduler of pool {pool.name!r} "
                                  f"took it over within {self.cfg.resume_timeout_s:g}s (resume_timeout_s; last try: {why})")
            await asyncio.sleep(delay)

    def _submit(self, scheduler, submit, output: ChoiceOutput, deadline: float | None, span):
        """A Submit of the request to `scheduler`, continuing after the tokens streamed so far
        (as output tokens: the worker replays them into the request's grammar too)."""
        del submit.output_token_ids[:], submit.output_logprobs[:]
        submit.output_token_ids.extend(output.token_ids)
        submit.output_logprobs.extend(output.logprobs)
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        return scheduler.Submit(submit, timeout=timeout, metadata=telemetry.metadata_with_context(span))

    async def _attach(self, submit, resume_from: int):
        """An Attach call to the scheduler holding the request; None (submit it afresh) when none
        holds it and the client has nothing of it yet. RouterError NOT_FOUND when none holds it."""
        rid = submit.request_id
        holder = await self.registry.request_holder(rid)
        channel = dict(await self.schedulers.channels([holder])).get(holder) if holder else None
        if channel is None:
            if resume_from == 0:
                return None
            log.info("request %s cannot be resumed: %s", rid, f"its holder {holder} does not answer" if holder else "no holder")
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"request_id {rid!r} is not held by any scheduler: it finished and was collected, "
                              f"was not resumed within the grace period, or its scheduler died", field="request_id")
        return scheduler_pb2_grpc.SchedulerStub(channel).Attach(
            scheduler_pb2.AttachRequest(request_id=rid, prompt_token_ids=submit.prompt_token_ids))

    def _record_finish(self, model: str, f: gen.Finish, max_tokens: int, span: telemetry.Span) -> None:
        m = self.metrics
        reason = gen.FinishReason.Name(f.reason).lower()
        m.success.labels(model, reason).inc()
        m.ttft.labels(model).observe(f.ttft_ms / 1000)
        m.e2e.labels(model).observe(f.total_ms / 1000)
        m.queue.labels(model).observe(f.queue_ms / 1000)
        m.prefill_time.labels(model).observe(max(0.0, f.ttft_ms - f.queue_ms) / 1000)
        m.decode_time.labels(model).observe(max(0.0, f.total_ms - f.ttft_ms) / 1000)
        m.inference_time.labels(model).observe(max(0.0, f.total_ms - f.queue_ms) / 1000)
        m.max_tokens.labels(model).observe(max_tokens)
        if f.completion_tokens > 1:
            m.tpot.labels(model).observe((f.total_ms - f.ttft_ms) / 1000 / (f.completion_tokens - 1))
        m.prompt_len.labels(model).observe(f.prompt_tokens)
        m.output_len.labels(model).observe(f.completion_tokens)
        m.prompt_tokens.labels(model).inc(f.prompt_tokens)
        m.generation_tokens.labels(model).inc(f.completion_tokens)
        span.set_attributes({"kvmesh.finish_reason": reason, "kvmesh.completion_tokens": f.completion_tokens,
                             "kvmesh.cached_prompt_tokens": f.cached_prompt_tokens, "kvmesh.queue_ms": f.queue_ms,
                             "kvmesh.ttft_ms": f.ttft_ms, "kvmesh.worker_id": f.worker_id,
                             "kvmesh.preemptions": f.preemptions, "kvmesh.model_version": f.model_version})
        if f.reason == gen.ERROR:
            span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, f.message))

    async def Generate(self, request, context):
        """Streams tokens with their text; the last message carries `finish` (reason, usage, timings,
        trace id). The trace id is also sent first, as `kvmesh-trace-id` response metadata."""
        metadata = context.invocation_metadata()
        span = self.open_span(metadata)
        stream = None
        try:
            if trace_id := telemetry.trace_id_hex(span):
                await context.send_initial_metadata((("kvmesh-trace-id", trace_id),))
            key = self.check_api_key(dict(metadata or ()).get("authorization"))
            # A request the client named can be resumed by that name: the scheduler holds it when the stream drops.
            stream = self.generate(request, context.time_remaining(), span, key, resumable=bool(request.request_id))
            async for out in stream:
                yield out
        except RouterError as e:
            await context.abort(e.code, e.message, e.trailing)
        finally:
            if stream is not None:
                await stream.aclose()  # at once, so a client that left frees its request upstream now
            span.end()

    async def _authorized(self, context) -> None:
        try:
            self.check_api_key(dict(context.invocation_metadata() or ()).get("authorization"))
        except RouterError as e:
            await context.abort(e.code, e.message)

    async def ListModels(self, request, context):
        await self._authorized(context)
        return gen.ListModelsResponse(models=self.model_infos())

    def model_infos(self) -> list[gen.ModelInfo]:
        """The pools with a ready worker, each with its versions, their share of traffic, and the
        rollout as this router last read it."""
        infos = []
        for p in self.pools.values():
            if not p.ready:
                continue
            info = gen.ModelInfo(name=p.name, aliases=p.aliases, ready_workers=p.ready_workers,
                                 max_context=p.model.max_position_embeddings,
                                 versions=[gen.ModelVersion(version=v, ready_workers=n, traffic_percent=p.traffic_percent(v))
                                           for v, n in sorted(p.versions.items())])
            if (r := p.rollout) is not None:
                info.rollout.CopyFrom(gen.RolloutInfo(status=r.status, stable_version=r.stable_version,
                                                      canary_version=r.canary_version, canary_percent=canary_percent(r)))
            infos.append(info)
        return infos

    async def Tokenize(self, request, context):
        """The ids the router would give `text` as a prompt; INVALID_ARGUMENT over max_prompt_chars."""
        await self._authorized(context)
        try:
            pool = self.pool_for(request.model)
            return gen.TokenizeResponse(ids=await self.tokenize(pool, request.text, "text"))
        except RouterError as e:
            await context.abort(e.code, e.message)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


async def _after_first(choices: list):
    """The choices' responses as they come: the first choice alone until its first response (its
    prompt is then computed and its full pages are in the prefix cache), then the others beside it.
    The first error raised ends them all."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(choice):
        try:
            async for out in choice:
                queue.put_nowait(out)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(finished)

    tasks = [asyncio.create_task(pump(choices[0]))]
    live = 1
    try:
        while live:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if len(tasks) == 1:  # the first choice's first response (or its end): start the rest
                tasks += [asyncio.create_task(pump(c)) for c in choices[1:]]
                live += len(choices) - 1
            if item is finished:
                live -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for choice in choices[len(tasks):]:
            await choice.aclose()


async def serve(common: CommonConfig, cfg: RouterConfig) -> None:
    from kvmesh.services.router.http import start_http

    telemetry.setup_tracing("router")
    registry = Registry(common.redis_url)
    limiter = KeyLimiter(common.redis_url)
    service = RouterService(cfg, registry, limiter, identity=mesh_identity(common))
    # The public ports: TLS only with a certificate of their own (the mesh's mTLS is for internal calls).
    server = ServiceServer(["kvmesh.v1.Generation"], lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(service, s),
                           common.host, cfg.port, public_server_credentials(cfg.tls_cert, cfg.tls_key),
                           max_message_bytes=cfg.max_request_bytes)
    service.stopping = server.stopping
    await server.start()
    address = advertised_address(common, server.port)
    try:
        http = await start_http(service, common.host, cfg.http_port, public_ssl_context(cfg.tls_cert, cfg.tls_key),
                                cfg.drain_s)
    except OSError:
        await server.stop(0)  # before the loop closes: the process exits with the error alone
        raise
    http_address = advertised_address(common, http[1]) if http else ""
    ready = asyncio.Event()

    async def on_ready(is_ready: bool):
        await server.set_serving(is_ready)
        if is_ready and not ready.is_set():
            ready.set()
            print(f"router ready on {address} (HTTP {http_address or 'off'})", flush=True)

    tasks = tuple(asyncio.create_task(t) for t in (service.discover(on_ready), service.watch_keys(), limiter.renew_leases()))

    async def end_tasks():  # after the drain: the calls in flight still resume on schedulers found meanwhile
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # SIGTERM: both ports stop taking calls at once and drain together (--drain-s).
    await serve_until_stopped(server, registry, "router", address, {"address": address, "http": http_address},
                              serving=False, grace=cfg.drain_s, drains=(http[0].cleanup,) if http else (),
                              cleanups=(end_tasks, limiter.close))
