"""What `kvmesh up` does while its mesh runs: restarts any service that dies (redis-server included),
replaces workers that are drained, and scales each pool to the worker count its scheduler asks for."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import redis as redis_module

from kvmesh.fleet.health import backoff_delay
from kvmesh.services.children import Child, worker_child
from kvmesh.services.registry import drain_key, pool_of, read_queue_states

BACKOFF_BASE_S, BACKOFF_CAP_S = 1.0, 30.0
STABLE_S = 60.0  # a child that served this long starts its backoff over at its next death
MAX_FAILED_STARTS = 5  # deaths in a row before serving: the service cannot start, stop the mesh


@dataclass
class Restarts:
    """One child's restart bookkeeping."""

    deaths: int = 0  # since it last served STABLE_S: the backoff exponent
    failed_starts: int = 0  # deaths in a row before it served
    serving_since: float | None = None  # when the current process first answered its health check
    restart_at: float | None = None  # set while it is dead and waiting out its backoff


class Supervisor:
    """What `kvmesh up` does while the mesh runs, one `poll()` at a time:
    - any child that exits (redis-server too) is started again with the same command line, so on
      the same ports, after an exponential backoff with full jitter;
    - a worker the scheduler drained (its drain key in Redis) is killed (it may hang) and replaced;
    - with `autoscale`, each pool gets the worker count its scheduler asks for (the
      `desired_workers` of its queue state): one cold start at a time, and only idle workers stop.
    `poll()` returns a message (the service, its last log lines, its log) when one child died
    MAX_FAILED_STARTS times in a row before serving; the caller then stops everything.
    The children given are taken to be serving (launch waited for them)."""

    def __init__(self, children: list[Child], redis_url: str, log_dir: str, autoscale: bool = False,
                 extra_worker: list[str] = (), folders: dict[str, str | None] | None = None,
                 redis: Child | None = None, health_credentials: tuple = (None, ())):
        from kvmesh.services.redis_client import connect

        self.children = children  # shared with the caller, who stops them: autoscaled workers are added here
        self.redis_child = redis
        self.redis = connect(redis_url, aio=False, socket_timeout=2, socket_connect_timeout=2)
        self.health_credentials = health_credentials  # how a new worker's health is checked (mTLS)
        self.redis_url, self.log_dir, self.autoscale = redis_url, log_dir, autoscale
        self.extra_worker = list(extra_worker)
        self.folders = folders or {}
        self.rng = random.Random()
        now = time.monotonic()
        self.restarts: dict[str, Restarts] = {c.name: Restarts(serving_since=now) for c in self.supervised()}
        self.events: list[str] = []  # what it did, for the console and for tests
        # One `default` pool: workers are worker-N (else POOL-worker-N).
        self.single = {c.pool for c in children if c.service == "scheduler"} == {"default"}

    def supervised(self) -> list[Child]:
        """Redis first: the services need it when they start again."""
        return [*([self.redis_child] if self.redis_child else []), *self.children]

    def workers(self, pool: str | None = None) -> list[Child]:
        return [c for c in self.children if c.service == "worker" and (pool is None or c.pool == pool)]

    def poll(self) -> str | None:
        now = time.monotonic()
        for child in self.supervised():
            if not child.retired and (fatal := self._watch(child, now)) is not None:
                return fatal
        try:
            self._replace_drained()
            if self.autoscale:
                self._scale()
        except redis_module.RedisError:
            pass  # Redis is restarting: drains and scaling wait for the next round
        return None

    def _note(self, text: str) -> None:
        self.events.append(text)
        print(text, flush=True)

    def _watch(self, child: Child, now: float) -> str | None:
        state = self.restarts.setdefault(child.name, Restarts())
        if child.process.poll() is None:
            if state.serving_since is None and child.serving(timeout_s=0.5):
                state.serving_since, state.failed_starts = now, 0
                self._note(f"{child.name} is serving")
            if state.serving_since is not None and now - state.serving_since > STABLE_S:
                state.deaths = 0
            return None
        if state.restart_at is None:  # it just died
            code = child.process.returncode
            if state.serving_since is None:
                state.failed_starts += 1
                if state.failed_starts >= MAX_FAILED_STARTS:
                    return child.failure(f"keeps failing at start ({state.failed_starts} times in a row, "
                                         f"last exit code {code})")
            delay = backoff_delay(state.deaths, BACKOFF_BASE_S, BACKOFF_CAP_S, self.rng)
            state.restart_at, state.serving_since = now + delay, None
            self._note(f"{child.name} exited with code {code}: restarting it in {delay:.1f}s (log {child.log_path})")
        elif now >= state.restart_at:
            if child.service == "worker":
                self._forget_drain(child)  # the new process must not be taken for the drained one
            child.start()
            state.deaths += 1
            state.restart_at = None
            self._note(f"{child.name} restarted (attempt {state.deaths})")
        return None

    def _forget_drain(self, child: Child) -> None:
        try:
            self.redis.delete(drain_key(child.name))
        except redis_module.RedisError:
            pass  # a fresh process clears its own drain key at start, too

    def _replace_drained(self) -> None:
        for child in self.workers():
            reason = self.redis.get(drain_key(child.name))
            if reason and child.process.poll() is None and self.restarts.get(child.name, Restarts()).restart_at is None:
                child.process.kill()  # SIGKILL works on a stopped (hung) process too
                child.process.wait()
                self.redis.delete(drain_key(child.name))
                self._note(f"{child.name} was drained ({reason}): replacing it")

    def _queue_states(self) -> dict[str, dict]:
        """Per pool, its schedulers' queue states merged: every worker, and the leader's autoscaling signal."""
        pools: dict[str, dict] = {}
        for state in read_queue_states(self.redis):
            merged = pools.setdefault(pool_of(state), {"workers": {}})
            merged["workers"].update(state["workers"])
            if "autoscale" in state:
                merged["autoscale"] = state["autoscale"]
        return pools

    def _scale(self) -> None:
        for pool, state in self._queue_states().items():
            live = [c for c in self.workers(pool) if not c.retired]
            desired = state.get("autoscale", {}).get("desired_workers", len(live))
            ready = {w for w, info in state["workers"].items() if info["alive"]}
            starting = [c for c in live if c.name not in ready]
            if desired > len(live) and not starting:
                self._add_worker(pool, state["autoscale"]["reason"])
            elif desired < len(live) and not starting:
                idle = [c for c in reversed(live) if not state["workers"].get(c.name, {}).get("running")
                        and not state["workers"].get(c.name, {}).get("waiting")]
                if idle:
                    idle[0].retired = True
                    idle[0].process.terminate()
                    self._note(f"autoscale {pool}: stopping idle {idle[0].name} ({len(live) - 1} workers; "
                               f"{state['autoscale']['reason']})")

    def _add_worker(self, pool: str, reason: str) -> None:
        gone = [c for c in self.workers() if c.retired and c.process.poll() is not None]
        for child in gone:  # a worker stopped by autoscaling frees its name for the next one
            self.children.remove(child)
            self.restarts.pop(child.name, None)
        names = {c.name for c in self.workers()}
        index = next(i for i in range(10_000) if (f"worker-{i}" if self.single else f"{pool}-worker-{i}") not in names)
        env = next((c.env for c in self.workers() if c.env), None)
        child = worker_child(pool, index, self.folders.get(pool), self.redis_url, self.log_dir, env, self.extra_worker,
                             self.single)
        child.health_credentials = self.health_credentials
        self.children.append(child)
        self.restarts[child.name] = Restarts()
        self._note(f"autoscale {pool}: starting {child.name} ({reason})")

    def close(self) -> None:
        self.redis.close()
