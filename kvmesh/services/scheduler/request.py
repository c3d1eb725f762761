"""A request as the scheduler tracks it: token ids in, token ids out, and how far its KV is computed.

There is no prefill or decode phase: `num_computed_tokens` catches up with `all_token_ids`, one
chunk per step, which covers chunked prefill, prefix hits and recompute after preemption alike.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvmesh.params import SamplingParams, StoppingParams


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens in plans sent to the worker whose results have not been applied (its chunk of the
    # step out; of two steps with overlapped steps): they count as computed once their result is.
    num_inflight_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    # Of the cached prompt tokens, those whose KV was fetched for it from a peer worker or a
    # host-memory tier (`transfer_source`) rather than found in the worker's own pool.
    num_transferred_prompt_tokens: int = 0
    transfer_source: str = ""
    # A fetch done before it was queued: (first page, pages fetched, source). Read at admission.
    fetched: tuple[int, int, str] | None = None
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Prompt pages it computes that others may wait for (hashes), and, while it waits, the running
    # request and page it waits for (Scheduler's in-batch prefix sharing).
    computing_hashes: list[bytes] = field(default_factory=list, repr=False)
    wait_for_page: "tuple[Request, int] | None" = field(default=None, repr=False)
    traceparent: str = ""  # W3C trace context of the scheduler's span for this request ("" when not traced)
    # Prompt and output in one list, kept as tokens arrive, so a step reads new pages' tokens
    # without copying the whole context.
    token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self):
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.token_ids.append(token_id)

    @property
    def all_token_ids(self) -> list[int]:
        """A copy of prompt plus output (for a worker that keeps its own)."""
        return list(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens it will have once the steps out come back: one more than `num_tokens` while the
        step out computes its last known token (and so samples the next one)."""
        pending = self.num_inflight_tokens and self.num_computed_tokens + self.num_inflight_tokens == len(self.token_ids)
        return len(self.token_ids) + bool(pending)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def stop_reason(self) -> FinishReason | None:
        """Why the request should stop after its latest token, if it should."""
        last = self.output_token_ids[-1]
        if not self.stopping.ignore_eos and last in self.eos_token_ids:
            return FinishReason.EOS
        if last in self.stopping.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.stopping.max_new_tokens:
            return FinishReason.LENGTH
        return None
