"""What a request asks for (sampling and stopping), and the one place its input is validated.

Every entry point (offline CLI, engine, router) calls `validate_request`; each rule has its own
message naming the field and the limit, so a user can fix the request from the error alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


GREEDY_BELOW_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """A request that breaks a rule; `field` names the offending field (gRPC INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 (or under 1e-5) is greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; the distribution is argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class StoppingParams:
    """When generation ends: EOS (unless ignored), a stop token id, or max_new_tokens."""

    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False


def validate_request(
    prompt_token_ids: list[int],
    sampling: SamplingParams,
    stopping: StoppingParams,
    *,
    max_context: int,
    vocab_size: int,
) -> None:
    """Raises InvalidRequest for the first rule the request breaks."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt", "must not be empty")
    if n > max_context:
        raise InvalidRequest("prompt", f"has {n} tokens, over the model's context of {max_context}")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if stopping.max_new_tokens < 1:
        raise InvalidRequest("max_new_tokens", f"must be at least 1, got {stopping.max_new_tokens}")
    if n + stopping.max_new_tokens > max_context:
        raise InvalidRequest(
            "max_new_tokens",
            f"prompt ({n} tokens) plus max_new_tokens ({stopping.max_new_tokens}) is over the model's context of {max_context}",
        )
    bad_stop = next((t for t in stopping.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequest("stop_token_ids", f"token id {bad_stop} is outside the vocabulary [0, {vocab_size})")
    _validate_sampling(sampling)


def _validate_sampling(s: SamplingParams) -> None:
    if not s.temperature >= 0.0:  # also rejects NaN
        raise InvalidRequest("temperature", f"must be >= 0 (0 is greedy), got {s.temperature}")
    if not 0.0 < s.top_p <= 1.0:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0 (0 disables it), got {s.top_k}")
    if not s.repetition_penalty > 0.0:
        raise InvalidRequest("repetition_penalty", f"must be > 0 (1 disables it), got {s.repetition_penalty}")
    if not -2.0 <= s.presence_penalty <= 2.0:
        raise InvalidRequest("presence_penalty", f"must be in [-2, 2], got {s.presence_penalty}")
    if not -2.0 <= s.frequency_penalty <= 2.0:
        raise InvalidRequest("frequency_penalty", f"must be in [-2, 2], got {s.frequency_penalty}")
    if s.seed is not None and not 0 <= s.seed < 2**63:
        raise InvalidRequest("seed", f"must be in [0, 2^63), got {s.seed}")
