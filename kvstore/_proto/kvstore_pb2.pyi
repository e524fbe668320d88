# mypy: ignore-errors
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STATUS_UNSPECIFIED: _ClassVar[PutStatus]
    PUT_STATUS_STORED: _ClassVar[PutStatus]
    PUT_STATUS_NOT_ADMITTED: _ClassVar[PutStatus]
PUT_STATUS_UNSPECIFIED: PutStatus
PUT_STATUS_STORED: PutStatus
PUT_STATUS_NOT_ADMITTED: PutStatus

class Scope(_message.Message):
    __slots__ = ("fingerprint", "tenant", "salt")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    tenant: str
    salt: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., tenant: _Optional[str] = ..., salt: _Optional[str] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("scope", "block_hash", "frame_size", "data")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    FRAME_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    block_hash: bytes
    frame_size: int
    data: bytes
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., block_hash: _Optional[bytes] = ..., frame_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[PutStatus]
    def __init__(self, status: _Optional[_Iterable[_Union[PutStatus, str]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("scope", "block_hashes", "layers", "single_reply")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_REPLY_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layers: LayerRange
    single_reply: bool
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ..., single_reply: _Optional[bool] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("index", "found", "header", "layers", "payload_size", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    header: bytes
    layers: LayerRange
    payload_size: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., header: _Optional[bytes] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ..., payload_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("scope", "block_hashes")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("present", "prefix_length")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    prefix_length: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., prefix_length: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("scope", "block_hashes")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class PutManifestRequest(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: bytes
    def __init__(self, manifest: _Optional[bytes] = ...) -> None: ...

class PutManifestReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ManifestKey(_message.Message):
    __slots__ = ("scope", "session_id")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    session_id: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class GetManifestReply(_message.Message):
    __slots__ = ("found", "manifest")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    found: bool
    manifest: bytes
    def __init__(self, found: _Optional[bool] = ..., manifest: _Optional[bytes] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStat(_message.Message):
    __slots__ = ("name", "blocks", "bytes_used", "bytes_budget", "hits", "misses", "puts", "rejected_puts", "corrupt", "errors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUTS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    blocks: int
    bytes_used: int
    bytes_budget: int
    hits: int
    misses: int
    puts: int
    rejected_puts: int
    corrupt: int
    errors: int
    def __init__(self, name: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., bytes_budget: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., rejected_puts: _Optional[int] = ..., corrupt: _Optional[int] = ..., errors: _Optional[int] = ...) -> None: ...

class StatReply(_message.Message):
    __slots__ = ("node_id", "draining", "blocks", "bytes_used", "bytes_budget", "put_bytes_received", "get_bytes_sent", "puts", "rejected_puts", "invalid_puts", "gets", "hits", "misses", "lookups", "repaired_blocks", "tiers", "data_port", "pending_writes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PUT_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GET_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUTS_FIELD_NUMBER: _ClassVar[int]
    INVALID_PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    draining: bool
    blocks: int
    bytes_used: int
    bytes_budget: int
    put_bytes_received: int
    get_bytes_sent: int
    puts: int
    rejected_puts: int
    invalid_puts: int
    gets: int
    hits: int
    misses: int
    lookups: int
    repaired_blocks: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStat]
    data_port: int
    pending_writes: int
    def __init__(self, node_id: _Optional[str] = ..., draining: _Optional[bool] = ..., blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., bytes_budget: _Optional[int] = ..., put_bytes_received: _Optional[int] = ..., get_bytes_sent: _Optional[int] = ..., puts: _Optional[int] = ..., rejected_puts: _Optional[int] = ..., invalid_puts: _Optional[int] = ..., gets: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., lookups: _Optional[int] = ..., repaired_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStat, _Mapping]]] = ..., data_port: _Optional[int] = ..., pending_writes: _Optional[int] = ...) -> None: ...
