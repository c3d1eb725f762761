from kvmesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "sampling", "page_ids", "num_computed_tokens", "traceparent")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _generation_pb2.SamplingParams
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    traceparent: str
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., page_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ScheduledChunk(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "new_page_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_tokens: int
    new_page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., new_page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step", "dropped", "new", "scheduled")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    NEW_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    step: int
    dropped: _containers.RepeatedScalarFieldContainer[str]
    new: _containers.RepeatedCompositeFieldContainer[NewSequence]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledChunk]
    def __init__(self, step: _Optional[int] = ..., dropped: _Optional[_Iterable[str]] = ..., new: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledChunk, _Mapping]]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_ids", "top_logprobs", "prompt")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt: LogprobsOfPrompt
    def __init__(self, seq_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt: _Optional[_Union[LogprobsOfPrompt, _Mapping]] = ...) -> None: ...

class LogprobsOfPrompt(_message.Message):
    __slots__ = ("logprobs", "top_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "tokens", "forward_ms", "error", "failed", "failure_reasons", "tier_stored", "tier_evicted", "spare_cores")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASONS_FIELD_NUMBER: _ClassVar[int]
    TIER_STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_EVICTED_FIELD_NUMBER: _ClassVar[int]
    SPARE_CORES_FIELD_NUMBER: _ClassVar[int]
    step: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    forward_ms: float
    error: str
    failed: _containers.RepeatedScalarFieldContainer[str]
    failure_reasons: _containers.RepeatedScalarFieldContainer[str]
    tier_stored: _containers.RepeatedScalarFieldContainer[bytes]
    tier_evicted: _containers.RepeatedScalarFieldContainer[bytes]
    spare_cores: int
    def __init__(self, step: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., forward_ms: _Optional[float] = ..., error: _Optional[str] = ..., failed: _Optional[_Iterable[str]] = ..., failure_reasons: _Optional[_Iterable[str]] = ..., tier_stored: _Optional[_Iterable[bytes]] = ..., tier_evicted: _Optional[_Iterable[bytes]] = ..., spare_cores: _Optional[int] = ...) -> None: ...

class ReadPagesRequest(_message.Message):
    __slots__ = ("hashes", "page_bytes", "dtype")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    page_bytes: int
    dtype: str
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., page_bytes: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class PageData(_message.Message):
    __slots__ = ("hash", "k", "v", "from_tier")
    HASH_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    FROM_TIER_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    k: bytes
    v: bytes
    from_tier: bool
    def __init__(self, hash: _Optional[bytes] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., from_tier: _Optional[bool] = ...) -> None: ...

class FetchPagesRequest(_message.Message):
    __slots__ = ("source", "hashes", "page_ids", "timeout_s")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    source: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, source: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., page_ids: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class FetchPagesResponse(_message.Message):
    __slots__ = ("pages", "bytes", "from_tier", "error")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FROM_TIER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    pages: int
    bytes: int
    from_tier: int
    error: str
    def __init__(self, pages: _Optional[int] = ..., bytes: _Optional[int] = ..., from_tier: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model", "num_pages", "page_size", "max_context", "vocab_size", "eos_token_ids", "epoch", "pool", "version", "check_prompt", "check_answer", "memory_used_bytes", "memory_total_bytes", "device_error", "device", "dtype", "page_bytes", "offload_bytes", "step_tokens", "lease_token", "owner")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECK_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHECK_ANSWER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ERROR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    num_pages: int
    page_size: int
    max_context: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    pool: str
    version: str
    check_prompt: _containers.RepeatedScalarFieldContainer[int]
    check_answer: _containers.RepeatedScalarFieldContainer[int]
    memory_used_bytes: int
    memory_total_bytes: int
    device_error: str
    device: str
    dtype: str
    page_bytes: int
    offload_bytes: int
    step_tokens: int
    lease_token: int
    owner: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., pool: _Optional[str] = ..., version: _Optional[str] = ..., check_prompt: _Optional[_Iterable[int]] = ..., check_answer: _Optional[_Iterable[int]] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., device_error: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., page_bytes: _Optional[int] = ..., offload_bytes: _Optional[int] = ..., step_tokens: _Optional[int] = ..., lease_token: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...
