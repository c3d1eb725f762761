"""Model pools as the router sees them: each pool (a model name clients ask for) has its tokenizer,
its schedulers and its ready workers per version, and maybe a canary rollout that splits its traffic.

The split is `kvmesh.fleet.canary.choose_version` over the request id: a pure function of the id
and the rollout state in Redis, so every router replica sends the same request the same way.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvmesh.fleet.canary import choose_version
from kvmesh.fleet.rollout import RolloutState, canary_percent, serving_stable
from kvmesh.services.worker.checkpoint import ModelConfig, load_config
from kvmesh.tokenizer import Tokenizer


def parse_models(spec: str, default_name: str) -> list[tuple[str, str]]:
    """`DIR`, `NAME=DIR` or several `NAME=DIR` separated by commas -> [(name, dir)]; '' is the
    default model under `default_name`. ValueError for an empty or repeated name."""
    if not spec.strip():
        return [(default_name, "")]
    pools = []
    for part in spec.split(","):
        name, sep, folder = part.strip().partition("=")
        if not sep:
            name, folder = default_name, part.strip()
        if not name or not folder:
            raise ValueError(f"model must be DIR or NAME=DIR[,NAME=DIR...], got {part!r}")
        pools.append((name.strip(), folder.strip()))
    names = [n for n, _ in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be distinct, got {names}")
    return pools


def served_names(pools: list[tuple[str, str]], served_model_name: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """[(name, folder, aliases)]: a pool started from a folder also answers to the folder's path as
    given, and a single pool to every comma-separated name of `served_model_name` (vLLM's
    --served-model-name). ValueError when such a name is another pool's, or names several pools."""
    extra = tuple(n.strip() for n in served_model_name.split(",") if n.strip())
    if extra and len(pools) > 1:
        raise ValueError("served_model_name: names one pool; with several, name each as NAME=DIR in --model")
    served = [(name, folder, tuple(dict.fromkeys(a for a in (folder, *extra) if a and a != name)))
              for name, folder in pools]
    seen: dict[str, str] = {}
    for name, _, aliases in served:
        for n in (name, *aliases):
            if seen.setdefault(n, name) != name:
                raise ValueError(f"model name {n!r} is served by both {seen[n]!r} and {name!r}")
    return served


@dataclass
class Pool:
    name: str
    model: ModelConfig
    tokenizer: Tokenizer
    aliases: tuple[str, ...] = ()  # other names clients may ask for: the folder as given, --served-model-name
    schedulers: list = field(default_factory=list)  # SchedulerLink of this pool's live schedulers
    versions: dict[str, int] = field(default_factory=dict)  # version -> ready workers
    rollout: RolloutState | None = None
    turn: int = 0  # round-robin over schedulers
    _by_address: dict = field(default_factory=dict)  # address -> (channel, link): links kept across rounds
    kv_tokens: int | None = None  # tokens the smallest ready worker's KV pool holds (None: not known yet)
    page_size: int = 0  # its workers' KV page size (0: not known yet)
    owners: dict = field(default_factory=dict)  # worker id -> (its scheduler's address, the worker's epoch)

    @classmethod
    def load(cls, name: str, folder: str, aliases: tuple[str, ...] = ()) -> "Pool":
        from kvmesh.modelgen import default_model_dir

        model_dir = Path(folder) if folder else default_model_dir()
        return cls(name, load_config(model_dir), Tokenizer.from_dir(model_dir), aliases=aliases)

    @property
    def ready_workers(self) -> int:
        return sum(self.versions.values())

    @property
    def ready(self) -> bool:
        return bool(self.schedulers) and self.ready_workers > 0

    def set_schedulers(self, peers: list[tuple[str, grpc.aio.Channel]], link_class) -> None:
        """The pool's live schedulers now: (address, channel) each, in a stable order; a
        `link_class(channel, address)` each (a SchedulerLink). A link left out is closed: the
        calls on it run to their end."""
        known = {}
        for address, channel in peers:
            previous = self._by_address.get(address)
            known[address] = previous if previous and previous[0] is channel else (channel, link_class(channel, address))
        for address, (_, link) in self._by_address.items():
            if known.get(address, (None, None))[1] is not link:
                link.close()
        self._by_address = known
        self.schedulers = [link for _, link in known.values()]

    def room_after(self, prompt_tokens: int) -> int:
        """Tokens a completion of this prompt can have: the rest of the context, and no more than
        a worker's KV pool holds beside the prompt (a request that could never fit is refused)."""
        room = self.model.max_position_embeddings - prompt_tokens
        if self.kv_tokens is not None:
            room = min(room, self.kv_tokens - prompt_tokens)
        return room

    def scheduler_at(self, address: str):
        """The link to the live scheduler at `address`, None when it is not one (or its connection just failed)."""
        known = self._by_address.get(address)
        if known is None or known[0].get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            return None
        return known[1]

    def live_schedulers(self) -> list[str]:
        """The addresses of the schedulers whose connection has not just failed."""
        return [a for a in self._by_address if self.scheduler_at(a) is not None]

    def next_scheduler(self):
        """Round-robin over the live schedulers, passing over one whose connection just failed (a
        scheduler that died and whose leases have not expired yet) while another can take the request."""
        addresses = list(self._by_address)
        for _ in range(len(addresses)):
            self.turn += 1
            if (stub := self.scheduler_at(addresses[self.turn % len(addresses)])) is not None:
                return stub
        return self.schedulers[self.turn % len(self.schedulers)]

    def version_for(self, request_id: str) -> str:
        """The version this request runs on ("" any): the canary's share while a rollout runs and
        the canary has ready workers, the stable version otherwise; after a rollout, the version
        that won (promoted canary, or the stable one after a rollback or abort)."""
        state = self.rollout
        if state is None:
            return ""
        if state.status == "running" and self.versions.get(state.canary_version):
            return choose_version(request_id or uuid.uuid4().hex, state.stable_version, state.canary_version,
                                  canary_percent(state))
        stable = serving_stable(state) if state.status != "running" else state.stable_version
        return stable if self.versions.get(stable) else ""

    def traffic_percent(self, version: str) -> float:
        """The share of new requests `version` gets now (for ListModels)."""
        if not self.versions.get(version):
            return 0.0
        state = self.rollout
        if state is None:
            return 100.0 * self.versions[version] / self.ready_workers
        if state.status == "running" and self.versions.get(state.canary_version):
            share = canary_percent(state)
            return share if version == state.canary_version else 100.0 - share if version == state.stable_version else 0.0
        stable = serving_stable(state) if state.status != "running" else state.stable_version
        if self.versions.get(stable):
            return 100.0 if version == stable else 0.0
        return 100.0 * self.versions[version] / self.ready_workers
