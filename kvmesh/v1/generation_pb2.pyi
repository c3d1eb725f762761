from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    EOS: _ClassVar[FinishReason]
    CANCELLED: _ClassVar[FinishReason]
    ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
LENGTH: FinishReason
STOP: FinishReason
EOS: FinishReason
CANCELLED: FinishReason
ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs", "logit_bias", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_object", "json_schema")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ...) -> None: ...

class StoppingParams(_message.Message):
    __slots__ = ("max_new_tokens", "stop", "stop_token_ids", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "sampling", "stopping", "priority", "request_id", "resume_from", "n", "stream_interval")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    stopping: StoppingParams
    priority: int
    request_id: str
    resume_from: int
    n: int
    stream_interval: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingParams, _Mapping]] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., resume_from: _Optional[int] = ..., n: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "logprob", "top_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("id", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "queue_ms", "ttft_ms", "total_ms", "message", "trace_id", "worker_id", "preemptions", "model_version", "resumes", "transferred_prompt_tokens", "transfer_source")
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float
    total_ms: float
    message: str
    trace_id: str
    worker_id: str
    preemptions: int
    model_version: str
    resumes: int
    transferred_prompt_tokens: int
    transfer_source: str
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., message: _Optional[str] = ..., trace_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., preemptions: _Optional[int] = ..., model_version: _Optional[str] = ..., resumes: _Optional[int] = ..., transferred_prompt_tokens: _Optional[int] = ..., transfer_source: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "finish", "request_id", "index", "prompt_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    finish: Finish
    request_id: str
    index: int
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., request_id: _Optional[str] = ..., index: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelVersion(_message.Message):
    __slots__ = ("version", "ready_workers", "traffic_percent")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_PERCENT_FIELD_NUMBER: _ClassVar[int]
    version: str
    ready_workers: int
    traffic_percent: float
    def __init__(self, version: _Optional[str] = ..., ready_workers: _Optional[int] = ..., traffic_percent: _Optional[float] = ...) -> None: ...

class RolloutInfo(_message.Message):
    __slots__ = ("status", "stable_version", "canary_version", "canary_percent")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_PERCENT_FIELD_NUMBER: _ClassVar[int]
    status: str
    stable_version: str
    canary_version: str
    canary_percent: float
    def __init__(self, status: _Optional[str] = ..., stable_version: _Optional[str] = ..., canary_version: _Optional[str] = ..., canary_percent: _Optional[float] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "ready_workers", "max_context", "versions", "aliases", "rollout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    READY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    ready_workers: int
    max_context: int
    versions: _containers.RepeatedCompositeFieldContainer[ModelVersion]
    aliases: _containers.RepeatedScalarFieldContainer[str]
    rollout: RolloutInfo
    def __init__(self, name: _Optional[str] = ..., ready_workers: _Optional[int] = ..., max_context: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[ModelVersion, _Mapping]]] = ..., aliases: _Optional[_Iterable[str]] = ..., rollout: _Optional[_Union[RolloutInfo, _Mapping]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...
