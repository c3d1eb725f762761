"""What a request asks for (sampling and stopping), and the one place its input is validated.

Every entry point (offline CLI, engine, router) calls `validate_request`, and the services behind
the router check again what they are sent (the scheduler the whole request, the worker each new
sequence's sampling): each rule has its own message naming the field and the limit, so a user
can fix the request from the error alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


GREEDY_BELOW_TEMPERATURE = 1e-5

# Limits that keep every sampled distribution finite (raw float32 logits divided by a temperature
# of at least 1e-5 and a repetition penalty of at least 0.01 stay far below float32's 3.4e38) and
# every request's per-token work small. vLLM bounds repetition_penalty by (0, 2]; the floor is
# ours: 1e-45 passed "> 0" and made the sampler meet inf and NaN.
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
MAX_STOP_TOKEN_IDS = 64  # every generated token is checked against them
MAX_REQUEST_ID_CHARS = 128
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit): a top-k per row per step
MAX_LOGIT_BIAS = 1024  # entries of logit_bias: each is applied to every draw of the sequence
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range, [-100, 100]: -100 bans a token, 100 all but forces it
MAX_CHOICES = 16  # completions per request (`n`, `best_of`): each is a sequence in a worker's batch
MAX_SEQUENCES = 64  # prompts times choices of one OpenAI completions request (a prompt list)
MAX_SCHEMA_CHARS = 64 << 10  # a structured output's JSON Schema text; it travels with every new sequence
STRUCTURED_KINDS = ("json_object", "json_schema")


class InvalidRequest(ValueError):
    """A request that breaks a rule; `field` names the offending field (gRPC INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class StructuredOutput:
    """The completion must be JSON: any object (`json_object`), or a value valid under `schema` (`json_schema`,
    a JSON Schema as JSON text). The worker's sampler enforces it token by token (kvmesh.grammar)."""

    kind: str
    schema: str = ""


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
    logprobs: int = 0  # alternatives reported per generated token
    prompt_logprobs: int | None = None  # None: no prompt logprobs; else alternatives per prompt token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
    structured_output: StructuredOutput | None = None

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
    """Raises InvalidRequest for the first rule the request breaks. `max_context` is the served
    context: the model's, or less where the worker's whole KV pool holds fewer tokens."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt", "must not be empty")
    if n > max_context:
        raise InvalidRequest("prompt", f"has {n} tokens, over the context of {max_context}")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if stopping.max_new_tokens < 1:
        raise InvalidRequest("max_new_tokens", f"must be at least 1, got {stopping.max_new_tokens}")
    if n + stopping.max_new_tokens > max_context:
        raise InvalidRequest(
            "max_new_tokens",
            f"prompt ({n} tokens) plus max_new_tokens ({stopping.max_new_tokens}) is over the context of {max_context}",
        )
    if len(stopping.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("stop_token_ids", f"has {len(stopping.stop_token_ids)} ids, over the limit of {MAX_STOP_TOKEN_IDS}")
    bad_stop = next((t for t in stopping.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequest("stop_token_ids", f"token id {bad_stop} is outside the vocabulary [0, {vocab_size})")
    if sampling.structured_output is not None and stopping.ignore_eos:
        raise InvalidRequest("ignore_eos", "cannot be set with structured_output (a finished grammar ends on EOS)")
    validate_sampling(sampling)
    validate_vocabulary(sampling, vocab_size)


def validate_request_id(request_id: str) -> None:
    """Raises InvalidRequest for a request_id over MAX_REQUEST_ID_CHARS (it is echoed in every response)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("request_id", f"has {len(request_id)} characters, over the limit of {MAX_REQUEST_ID_CHARS}")


def validate_sampling(s: SamplingParams) -> None:
    """Raises InvalidRequest for the first sampling value outside its limit (NaN is outside every
    limit). Values that pass keep the sampler's probabilities finite."""
    if not 0.0 <= s.temperature <= MAX_TEMPERATURE:
        raise InvalidRequest("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {s.temperature}")
    if not 0.0 < s.top_p <= 1.0:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0 (0 disables it), got {s.top_k}")
    if not MIN_REPETITION_PENALTY <= s.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidRequest("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                                                   f"(1 disables it), got {s.repetition_penalty}")
    if not -2.0 <= s.presence_penalty <= 2.0:
        raise InvalidRequest("presence_penalty", f"must be in [-2, 2], got {s.presence_penalty}")
    if not -2.0 <= s.frequency_penalty <= 2.0:
        raise InvalidRequest("frequency_penalty", f"must be in [-2, 2], got {s.frequency_penalty}")
    if s.seed is not None and not 0 <= s.seed < 2**63:
        raise InvalidRequest("seed", f"must be in [0, 2^63), got {s.seed}")
    if not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
    if s.prompt_logprobs is not None and not 0 <= s.prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {s.prompt_logprobs}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest("logit_bias", f"has {len(s.logit_bias)} entries, over the limit of {MAX_LOGIT_BIAS}")
    for token_id, bias in s.logit_bias:
        if not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
            raise InvalidRequest("logit_bias", f"the bias of token {token_id} must be in "
                                               f"[-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {bias}")
    if s.structured_output is not None:
        validate_structured_output(s.structured_output)


def validate_vocabulary(s: SamplingParams, vocab_size: int) -> None:
    """Raises InvalidRequest for a logit_bias token outside the vocabulary [0, vocab_size)."""
    bad = next((t for t, _ in s.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def validate_structured_output(so: StructuredOutput) -> None:
    """Raises InvalidRequest for an unknown kind, or a schema over MAX_SCHEMA_CHARS or not a JSON
    object. Whether the grammar library can compile the schema is kvmesh.grammar.check's question."""
    if so.kind not in STRUCTURED_KINDS:
        raise InvalidRequest("structured_output", f"must be one of {', '.join(STRUCTURED_KINDS)}, got {so.kind!r}")
    if so.kind != "json_schema":
        return
    if len(so.schema) > MAX_SCHEMA_CHARS:
        raise InvalidRequest("structured_output.json_schema",
                             f"has {len(so.schema)} characters, over the limit of {MAX_SCHEMA_CHARS}")
    try:
        schema = json.loads(so.schema)
    except (ValueError, RecursionError):
        raise InvalidRequest("structured_output.json_schema", "is not valid JSON") from None
    if not isinstance(schema, dict):
        raise InvalidRequest("structured_output.json_schema", "must be a JSON object (a JSON Schema)")
