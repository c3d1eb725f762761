from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageOp(_message.Message):
    __slots__ = ("kind", "seq_id", "page_ids", "num_tokens", "token_ids", "traceparent")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[PageOp.Kind]
        OPEN: _ClassVar[PageOp.Kind]
        GROW: _ClassVar[PageOp.Kind]
        COMMIT: _ClassVar[PageOp.Kind]
        RELEASE: _ClassVar[PageOp.Kind]
    KIND_UNSPECIFIED: PageOp.Kind
    OPEN: PageOp.Kind
    GROW: PageOp.Kind
    COMMIT: PageOp.Kind
    RELEASE: PageOp.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    kind: PageOp.Kind
    seq_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    traceparent: str
    def __init__(self, kind: _Optional[_Union[PageOp.Kind, str]] = ..., seq_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "num_pages", "page_size", "ops", "forget", "lease_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    FORGET_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    num_pages: int
    page_size: int
    ops: _containers.RepeatedCompositeFieldContainer[PageOp]
    forget: bool
    lease_token: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[PageOp, _Mapping]]] = ..., forget: _Optional[bool] = ..., lease_token: _Optional[int] = ...) -> None: ...

class ApplyResponse(_message.Message):
    __slots__ = ("diverged",)
    DIVERGED_FIELD_NUMBER: _ClassVar[int]
    diverged: bool
    def __init__(self, diverged: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerPages(_message.Message):
    __slots__ = ("worker_id", "total_pages", "free_pages", "used_pages", "cached_pages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    total_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    def __init__(self, worker_id: _Optional[str] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerPages]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerPages, _Mapping]]] = ...) -> None: ...
