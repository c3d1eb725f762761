"""The step contract between the scheduler and a worker: one StepPlan in, one StepResult out.

The worker keeps each sequence's tokens and page table between steps, so a plan carries only
deltas: sequences new to the worker, pages appended, sequences to forget. A sequence is sampled
in a step exactly when the step brings its computed tokens level with its known tokens; the
scheduler and the worker both apply that rule, so neither has to tell the other.
The mesh's worker.proto mirrors these types field for field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.params import SamplingParams


@dataclass
class NewSequence:
    """A sequence the worker has not seen (or has dropped, e.g. after preemption).

    `token_ids` is the prompt plus any output already streamed (a recomputed sequence resumes
    where it stopped). `num_computed_tokens` tokens already have KV in `page_ids` (prefix hits).
    """

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    page_ids: list[int]
    num_computed_tokens: int = 0
    traceparent: str = ""  # the request's trace context, parent of its kvmesh.token_step spans


@dataclass
class ScheduledChunk:
    """Run `num_tokens` more of this sequence's tokens; `new_page_ids` extend its page table first."""

    seq_id: str
    num_tokens: int
    new_page_ids: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    dropped: list[str] = field(default_factory=list)
    new: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.scheduled)


@dataclass
class PromptLogprobs:
    """Prompt tokens 1..n-1: each one's logprob given the tokens before it, and k alternatives per
    position, flattened (best first)."""

    logprobs: list[float]
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SampledToken:
    """A sampled token with its raw logprob; with SamplingParams.logprobs = k, the k likeliest
    tokens (best first); with prompt_logprobs, on the sequence's first token, the prompt's."""

    seq_id: str
    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    prompt: PromptLogprobs | None = None


@dataclass
class StepResult:
    tokens: list[SampledToken]
    forward_s: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)  # seq id -> why, for sequences that failed alone (no token)
    # Page hashes that entered and left the worker's host-memory tier during the step (its owner
    # reports them; the scheduler's view of the tier follows). See services/worker/page_store.py.
    tier_stored: list[bytes] = field(default_factory=list)
    tier_evicted: list[bytes] = field(default_factory=list)
    spare_cores: int = 0  # cores the step's thread team left to the rest of the host (worker.proto)
