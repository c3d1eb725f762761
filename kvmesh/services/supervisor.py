"""What `kvmesh up` does while its mesh runs: replaces workers that exit or are drained, and
scales each pool to the worker count its scheduler asks for."""

from __future__ import annotations

import time

from kvmesh.services.launcher import Child, worker_child


class Supervisor:
    """What `kvmesh up` does while the mesh runs, one `poll()` at a time:
    - a worker that exits is started again, after an exponential backoff with full jitter;
    - a worker the scheduler drained (its drain key in Redis) is killed (it may hang) and replaced;
    - with `autoscale`, each pool gets the worker count its scheduler asks for (the
      `desired_workers` of its queue state): one cold start at a time, and only idle workers stop.
    Any other service exiting is fatal: `poll()` returns a message and the caller stops everything."""

    def __init__(self, children: list[Child], redis_url: str, log_dir: str, autoscale: bool = False,
                 extra_worker: list[str] = (), folders: dict[str, str | None] | None = None):
        import random

        from kvmesh.services.redis_client import connect

        self.children = children
        self.redis = connect(redis_url, aio=False)
        self.redis_url, self.log_dir, self.autoscale = redis_url, log_dir, autoscale
        self.extra_worker = list(extra_worker)
        self.folders = folders or {}
        self.rng = random.Random()
        self.restarts: dict[str, tuple[int, float]] = {}  # worker name -> (attempts, restart at)
        self.started_at: dict[str, float] = {}
        self.events: list[str] = []  # what it did, for the console and for tests
        self.single = any(c.name == "scheduler" for c in children)  # one `default` pool: workers are worker-N

    def workers(self, pool: str | None = None) -> list[Child]:
        return [c for c in self.children if c.service == "worker" and (pool is None or c.pool == pool)]

    def poll(self) -> str | None:
        for child in self.children:
            if child.service != "worker" and child.process.poll() is not None:
                return f"{child.name} exited with code {child.process.returncode}; see {self.log_dir}"
        self._replace_drained()
        self._restart_exited()
        if self.autoscale:
            self._scale()
        return None

    def _note(self, text: str) -> None:
        self.events.append(text)
        print(text, flush=True)

    def _replace_drained(self) -> None:
        from kvmesh.services.registry import drain_key

        for child in self.workers():
            reason = self.redis.get(drain_key(child.name))
            if reason and child.process.poll() is None and child.name not in self.restarts:
                child.process.kill()  # SIGKILL works on a stopped (hung) process too
                child.process.wait()
                self.redis.delete(drain_key(child.name))
                self._note(f"{child.name} was drained ({reason}): replacing it")

    def _restart_exited(self) -> None:
        from kvmesh.fleet.health import backoff_delay
        from kvmesh.services.registry import drain_key

        now = time.monotonic()
        for child in self.workers():
            if child.process.poll() is None:
                if now - self.started_at.get(child.name, 0) > 120:
                    self.restarts.pop(child.name, None)  # ran long enough: the next failure starts over
                continue
            if child.retired:
                continue
            attempts, at = self.restarts.get(child.name, (0, None))
            if at is None:
                at = now + backoff_delay(attempts, 1.0, 30.0, self.rng)
                self.restarts[child.name] = (attempts, at)
            elif now >= at:
                self.redis.delete(drain_key(child.name))  # the new process must not be taken for the drained one
                child.start()
                self.started_at[child.name] = now
                self.restarts[child.name] = (attempts + 1, None)
                self._note(f"{child.name} restarted (attempt {attempts + 1})")

    def _queue_states(self) -> dict[str, dict]:
        from kvmesh.services.registry import pool_of, read_queue_states

        return {pool_of(s): s for s in read_queue_states(self.redis)}

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
        names = {c.name for c in self.workers()}
        index = next(i for i in range(10_000) if (f"worker-{i}" if self.single else f"{pool}-worker-{i}") not in names)
        env = next((c.env for c in self.children if c.env), None)
        child = worker_child(pool, index, self.folders.get(pool), self.redis_url, self.log_dir, env, self.extra_worker,
                             self.single)
        self.children.append(child)
        self.started_at[child.name] = time.monotonic()
        self._note(f"autoscale {pool}: starting {child.name} ({reason})")

    def close(self) -> None:
        self.redis.close()
