"""The scheduler's fleet duties for its pool, beside batching: health checks that drain and replace
sick workers, the canary rollout controller, and the autoscaling signal.

The decisions are the pure cores in `kvmesh.fleet`; this module feeds them what the scheduler
sees (finished requests per version, check results, the token queue) and acts on their answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

import grpc
import numpy as np

from kvmesh.fleet.autoscale import Autoscaler, PoolSignals
from kvmesh.fleet.health import DRAIN, HealthTracker
from kvmesh.fleet.rollout import RolloutState, WindowStats, evaluate
from kvmesh.params import SamplingParams, StoppingParams
from kvmesh.services.scheduler.request import FinishReason, Request
from kvmesh.v1 import worker_pb2

log = logging.getLogger("kvmesh.scheduler.fleet")

CHECK_PRIORITY = 1_000_000  # a health check is admitted ahead of any queue


@dataclass(frozen=True)
class Outcome:
    at: float  # wall-clock seconds (rollout windows are shared across processes through Redis)
    version: str
    latency_s: float  # arrival to last token, at the scheduler
    ttft_s: float | None
    error: bool


class Outcomes:
    """Recently finished requests, for rollout windows and the TTFT guardrail."""

    def __init__(self, keep: int = 50_000):
        self.items: deque[Outcome] = deque(maxlen=keep)

    def record(self, version: str, req: Request) -> None:
        if req.finish_reason is FinishReason.CANCELLED:
            return  # the client left: says nothing about the version
        end = req.finish_time or time.monotonic()
        ttft = req.first_token_time - req.arrival_time if req.first_token_time else None
        self.items.append(Outcome(time.time(), version, end - req.arrival_time, ttft,
                                  req.finish_reason is FinishReason.ERROR))

    def window(self, version: str, since: float) -> WindowStats:
        recent = [o for o in self.items if o.version == version and o.at >= since]
        # Latency of the requests that succeeded; if none did, of all (the error rate decides then).
        latencies = [o.latency_s for o in recent if not o.error] or [o.latency_s for o in recent]
        p99 = float(np.percentile(latencies, 99)) if latencies else None
        return WindowStats(len(recent), sum(o.error for o in recent), p99)

    def ttft_p95(self, since: float) -> float | None:
        ttfts = [o.ttft_s for o in self.items if o.at >= since and o.ttft_s is not None]
        return float(np.percentile(ttfts, 95)) if ttfts else None


class HealthChecks:
    """Every interval, each worker gets an inference check (the canned prompt it answered at start-up
    must give the same greedy tokens, within the interval) and a memory check (Info: used / total
    under memory_limit_fraction, answered within the interval). `health_check_failures` failures in
    a row drain the worker: its requests move to other workers, it gets nothing new, and its drain
    key in Redis tells `kvmesh up` (or the worker itself) to replace it."""

    def __init__(self, service):
        self.service = service
        self.cfg = service.cfg
        self.tracker = HealthTracker(self.cfg.health_check_failures)

    async def run(self) -> None:
        interval = self.cfg.health_check_interval_s
        while True:
            started = time.monotonic()
            loops = [w for w in self.service.workers.values() if w.alive and not w.draining]
            try:
                await asyncio.gather(*(self.check(w, interval * 0.9) for w in loops))
            except Exception:  # a bug here must not stop the checks
                log.exception("health checks failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def check(self, loop, timeout: float) -> None:
        inference, (memory, device) = await asyncio.gather(self.inference(loop, timeout), self.reported(loop, timeout))
        for check, (ok, detail) in (("inference", inference), ("memory", memory), ("device", device)):
            if ok is None:
                continue
            transition = self.tracker.record(loop.worker_id, check, ok, detail)
            if transition is not None:
                log.warning("worker %s: %s -> %s (%s)", loop.worker_id, transition.old, transition.new, transition.reason)
            if transition is not None and transition.new == DRAIN and not loop.draining:
                await self.drain(loop, transition.reason)

    async def inference(self, loop, timeout: float) -> tuple[bool | None, str]:
        """(ok, detail); ok is None when the check never got a place in a batch before the timeout:
        a busy worker is not a sick one (a hung one fails the memory check, which needs no batch)."""
        info = loop.info
        req = Request(f"health-check-{uuid.uuid4().hex[:12]}", list(info.check_prompt), SamplingParams(temperature=0.0),
                      StoppingParams(max_new_tokens=len(info.check_answer), ignore_eos=True), priority=CHECK_PRIORITY)
        tokens: list[int] = []
        try:
            queue = loop.submit(req, [], 0)
        except ValueError as e:
            return False, str(e)
        loop.health_checks.add(req.request_id)

        async def answer() -> None:
            while True:
                event = await queue.get()
                if event.token_id is not None:
                    tokens.append(event.token_id)
                if event.finish_reason is not None:
                    return

        try:
            await asyncio.wait_for(answer(), timeout)
        except asyncio.TimeoutError:
            if req.first_scheduled_time is None:
                return None, "not admitted in time (the worker is busy): inconclusive"
            return False, f"no answer within {timeout:.1f}s ({len(tokens)} of {len(info.check_answer)} tokens)"
        finally:
            loop.health_checks.discard(req.request_id)
            loop.done(req.request_id, [], finished=req.is_finished)
        if tokens != list(info.check_answer):
            return False, f"answered {tokens}, expected {list(info.check_answer)}"
        return True, ""

    async def reported(self, loop, timeout: float) -> tuple[tuple[bool, str], tuple[bool | None, str]]:
        """The memory and device checks, from what the worker reports (`Info`): memory under
        memory_limit_fraction, and no device error (ECC, XID on CUDA). A worker that does not answer
        fails the memory check; its device check is then inconclusive."""
        if loop.stub is None:
            return (True, ""), (True, "")
        try:
            info = await loop.stub.Info(worker_pb2.InfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return (False, f"Info failed: {e.code().name}"), (None, "")
        memory = True, ""
        if info.memory_total_bytes and info.memory_used_bytes > self.cfg.memory_limit_fraction * info.memory_total_bytes:
            memory = False, (f"{info.memory_used_bytes >> 20} MiB used of {info.memory_total_bytes >> 20} MiB, over "
                             f"memory_limit_fraction={self.cfg.memory_limit_fraction}")
        device = (False, f"{info.device} reports {info.device_error}") if info.device_error else (True, "")
        return memory, device

    async def drain(self, loop, reason: str) -> None:
        loop.draining = True
        moved = self.service.move_requests(loop, reason)
        loop.stop()
        self.service.metrics.drained.labels(self.cfg.pool).inc()
        log.error("drained worker %s (%s); %d requests moved to other workers", loop.worker_id, reason, moved)
        try:
            await self.service.registry.mark_drained(loop.worker_id, reason)
        except Exception as e:
            log.warning("could not record the drain of %s: %s", loop.worker_id, e)

    def forget(self, worker_id: str) -> None:
        self.tracker.forget(worker_id)


class PoolLeader:
    """The pool's leader lease: of the pool's schedulers, the holder runs the duties that must run
    once per pool (the rollout controller, the autoscaling signal). Renewed every second with a
    3 s TTL, so a dead leader's duties move to a survivor within about 4 s. While Redis does not
    answer, `held` stays as it was (nobody can take the lease meanwhile)."""

    TTL_S = 3.0

    def __init__(self, registry, pool: str, holder: str):
        self.registry, self.pool, self.holder = registry, pool, holder
        self.held = False

    async def run(self) -> None:
        while True:
            try:
                held = await self.registry.hold_lease(f"scheduler-leader:{self.pool}", self.holder, self.TTL_S)
                if held != self.held:
                    log.warning("%s the leader of pool %s", "became" if held else "is no longer", self.pool)
                self.held = held
            except Exception:  # Redis down: the discovery loop reports the outage
                pass
            await asyncio.sleep(1.0)


class RolloutController:
    """Drives the pool's canary rollout (state in Redis, written with compare-and-set) once a second,
    on the pool's leader only. The leader judges from the requests it scheduled itself: with several
    schedulers, a sample of the pool's traffic (the router spreads requests over them evenly)."""

    def __init__(self, service):
        self.service = service

    async def run(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.tick()
            except Exception as e:  # Redis hiccup: next second
                log.warning("rollout controller: %s", e)

    async def tick(self) -> None:
        registry, pool = self.service.registry, self.service.cfg.pool
        if not self.service.leader.held:
            return
        stored = await registry.rollout(pool)
        if stored is None or stored.get("status") != "running":
            return
        state = RolloutState.from_json(stored)
        now = time.time()
        since = max(state.step_started_at, now - state.interval_s)
        outcomes = self.service.outcomes
        new = evaluate(state, outcomes.window(state.stable_version, since), outcomes.window(state.canary_version, since), now)
        if new != state and await registry.replace_rollout(pool, stored, new.to_json()):
            log.warning("rollout of %s: %s (%s)", pool, new.history[-1].action, new.history[-1].reason)


class AutoscaleSignal:
    """The pool's desired worker count from the pool's token queue and the TTFT p95 of the last
    minute (of the requests this scheduler saw); computed by the pool's leader, exported as
    kvmesh_desired_workers{pool} and in its queue state, where `kvmesh up --autoscale` reads it."""

    def __init__(self, service):
        self.service = service
        self.autoscaler = Autoscaler(service.cfg.autoscale_policy())
        self.last = None

    def update(self, estimated_tokens: int, live_workers: int) -> dict:
        signals = PoolSignals(estimated_tokens, self.service.outcomes.ttft_p95(time.time() - 60), live_workers)
        self.last = decision = self.autoscaler.desired_workers(signals, live_workers, time.monotonic())
        self.service.metrics.desired_workers.labels(self.service.cfg.pool).set(decision.workers)
        return {"desired_workers": decision.workers, "reason": decision.reason}
