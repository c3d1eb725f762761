"""`kvmesh rollout start|status|abort`: writes and reads a pool's rollout state in Redis.

The pool's scheduler drives a running rollout (kvmesh.services.scheduler.fleet.RolloutController)
and every router splits traffic from the same state; this command only starts, shows and aborts.
"""

from __future__ import annotations

import argparse
import re
import time

from kvmesh.fleet.rollout import RolloutState, abort, canary_percent, start_rollout
from kvmesh.services.registry import Registry, ready_versions

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(text: str) -> float:
    """'90', '60s', '5m', '1h', '500ms' -> seconds; ValueError naming the value otherwise."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"interval must be a duration such as 60s, 5m or 1h, got {text!r}")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]


def parse_steps(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"steps must be comma-separated percents such as 1,5,25,50,100, got {text!r}") from None


async def start(registry: Registry, args: argparse.Namespace) -> int:
    if not args.canary:
        raise ValueError("start needs --canary VERSION")
    current = await registry.rollout(args.model)
    if current is not None and current["status"] == "running":
        raise ValueError(f"a rollout of {args.model} to {current['canary_version']} is running: abort it first")
    versions = ready_versions(await registry.services("worker"), args.model)
    stable = args.stable
    if stable is None:
        others = sorted(v for v in versions if v != args.canary)
        if len(others) != 1:
            raise ValueError(f"cannot tell the stable version of {args.model} (ready versions: {sorted(versions)}): "
                             "pass --stable VERSION")
        stable = others[0]
    state = start_rollout(args.model, stable, args.canary, time.time(), steps=parse_steps(args.steps),
                          interval_s=parse_duration(args.interval), min_requests=args.min_requests,
                          max_p99_ratio=args.max_p99_ratio)
    if not await registry.replace_rollout(args.model, current, state.to_json()):
        raise ValueError("the rollout state changed meanwhile; try again")
    print(f"rollout of {args.model}: {args.canary} at {canary_percent(state):g}% beside {stable}"
          + ("" if versions.get(args.canary) else f" (no ready {args.canary} worker yet: it gets traffic once one is ready)"))
    return 0


def show(state: RolloutState) -> str:
    lines = [f"{state.model}: {state.status}, canary {state.canary_version} at {canary_percent(state):g}% "
             f"(stable {state.stable_version}), steps {'/'.join(f'{s:g}' for s in state.steps)}, "
             f"interval {state.interval_s:g}s"]
    for d in state.history:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.at))
        lines.append(f"  {stamp}  {d.action:<8} {d.percent:>5g}%  {d.reason}")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    registry = Registry(args.redis_url)
    try:
        if args.action == "start":
            return await start(registry, args)
        stored = await registry.rollout(args.model)
        if stored is None:
            raise ValueError(f"no rollout of {args.model} has been started")
        state = RolloutState.from_json(stored)
        if args.action == "abort":
            state = abort(state, time.time(), args.reason)
            if not await registry.replace_rollout(args.model, stored, state.to_json()):
                raise ValueError("the rollout state changed meanwhile; try again")
        print(show(state))
        return 0
    finally:
        await registry.close()
