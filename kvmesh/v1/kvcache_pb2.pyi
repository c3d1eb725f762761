from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageCounts(_message.Message):
    __slots__ = ("used", "free", "cached")
    USED_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    used: int
    free: int
    cached: int
    def __init__(self, used: _Optional[int] = ..., free: _Optional[int] = ..., cached: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "num_pages", "page_size", "lease_token", "stored", "evicted", "full", "forget", "pages", "tier_pages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    FORGET_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TIER_PAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    num_pages: int
    page_size: int
    lease_token: int
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    evicted: _containers.RepeatedScalarFieldContainer[bytes]
    full: bool
    forget: bool
    pages: PageCounts
    tier_pages: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., lease_token: _Optional[int] = ..., stored: _Optional[_Iterable[bytes]] = ..., evicted: _Optional[_Iterable[bytes]] = ..., full: _Optional[bool] = ..., forget: _Optional[bool] = ..., pages: _Optional[_Union[PageCounts, _Mapping]] = ..., tier_pages: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("resync",)
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    resync: bool
    def __init__(self, resync: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WorkerPrefix(_message.Message):
    __slots__ = ("worker_id", "pages", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pages: int
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., pages: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("workers", "room_pages")
    class RoomPagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROOM_PAGES_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerPrefix]
    room_pages: _containers.ScalarMap[str, int]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerPrefix, _Mapping]]] = ..., room_pages: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerPages(_message.Message):
    __slots__ = ("worker_id", "total_pages", "free_pages", "used_pages", "cached_pages", "indexed_pages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    INDEXED_PAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    total_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    indexed_pages: int
    def __init__(self, worker_id: _Optional[str] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., indexed_pages: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerPages]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerPages, _Mapping]]] = ...) -> None: ...
