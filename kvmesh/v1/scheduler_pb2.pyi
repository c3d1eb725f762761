from kvmesh.v1 import generation_pb2 as _generation_pb2
from kvmesh.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRequest(_message.Message):
    __slots__ = ("call_id", "submit", "cancel", "timeout_s", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    submit: SubmitRequest
    cancel: bool
    timeout_s: float
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, call_id: _Optional[int] = ..., submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("call_id", "event", "end", "code", "details", "trailing_metadata")
    class TrailingMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    event: TokenEvent
    end: bool
    code: int
    details: str
    trailing_metadata: _containers.ScalarMap[str, str]
    def __init__(self, call_id: _Optional[int] = ..., event: _Optional[_Union[TokenEvent, _Mapping]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stopping", "priority", "version", "output_token_ids", "output_logprobs", "resumes", "resumable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    stopping: _generation_pb2.StoppingParams
    priority: int
    version: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    resumes: int
    resumable: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[_generation_pb2.StoppingParams, _Mapping]] = ..., priority: _Optional[int] = ..., version: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., resumes: _Optional[int] = ..., resumable: _Optional[bool] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "cached_prompt_tokens", "queue_ms", "worker_id", "message", "preemptions", "version", "worker_lost", "resumes", "transferred_prompt_tokens", "transfer_source", "top_ids", "top_logprobs", "prompt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_LOST_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _generation_pb2.FinishReason
    cached_prompt_tokens: int
    queue_ms: float
    worker_id: str
    message: str
    preemptions: int
    version: str
    worker_lost: bool
    resumes: int
    transferred_prompt_tokens: int
    transfer_source: str
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt: _worker_pb2.LogprobsOfPrompt
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., cached_prompt_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., worker_id: _Optional[str] = ..., message: _Optional[str] = ..., preemptions: _Optional[int] = ..., version: _Optional[str] = ..., worker_lost: _Optional[bool] = ..., resumes: _Optional[int] = ..., transferred_prompt_tokens: _Optional[int] = ..., transfer_source: _Optional[str] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt: _Optional[_Union[_worker_pb2.LogprobsOfPrompt, _Mapping]] = ...) -> None: ...
