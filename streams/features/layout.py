"""Feast's Redis online-store layout, written and read without Feast: the one place that knows it.

The engines write their rows straight into Feast's Redis store, and the rules read them from it,
so the online store *is* Feast's: ``FeatureStore.get_online_features`` (in ``.venv-feast``) reads
what the engines wrote, and neither side needs a bridge. The layout is the one of Feast 0.67's
``RedisOnlineStore`` (``feast/infra/online_stores/redis.py``, ``helpers.py``,
``key_encoding_utils.py``):

- **key**: ``serialize_entity_key(EntityKey(join_keys=[k], entity_values=[Value(string_val=v)]),
  entity_key_serialization_version=3)`` followed by the project name, i.e. little-endian
  ``uint32`` fields: number of join keys (1), ``ValueType.STRING`` (2), ``len(k)``, ``k``,
  then ``ValueType.STRING``, ``len(v)``, ``v`` — then ``project`` (UTF-8);
- **one hash per entity and project**; a feature's field is ``mmh3("<feature view>:<feature>")``
  (murmur3 32-bit, unsigned, 4 bytes little-endian), its value a serialized ``feast.types.Value``
  (``int64_val`` = 4 for the Int64 fields, ``double_val`` = 5 for the Float64 features; a null
  is the empty message, ``b""``);
- ``_ts:<feature view>``: the row's event time as a serialized ``google.protobuf.Timestamp``
  (here ``window_end``, as the push source's ``event_timestamp``);
- **expiry**: ``EXPIRE key key_ttl_seconds`` after every write (the feature set's ``online.ttl_s``,
  the ``key_ttl_seconds`` that ``streams.feast.repo`` writes into ``feature_store.yaml``);
- **newest wins**: a row whose event time is not newer than the stored ``_ts`` is skipped,
  as Feast's ``online_write_batch`` does.

The project, the feature view and the join key come from ``streams.feast.repo`` (``Names``,
``feature_columns``, ``ENTITY_KEY_SERIALIZATION_VERSION``), the same helpers the generated Feast
repository uses, so the two cannot drift. Only protobuf and mmh3 here (no Feast, no Redis client):
the application, the Faust job and the Feast environment all import it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import mmh3
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.timestamp_pb2 import Timestamp

from streams.columnar import varint
from streams.features.spec import FeatureSet

#: The row's column that is its event time for Feast (``_ts:<view>`` in Redis): the window's end, epoch ms.
EVENT_TIME_COLUMN = "window_end"
#: How Feast serializes entity keys in this repository (``feature_store.yaml``) and in the repository ``streams.feast.repo`` writes.
ENTITY_KEY_SERIALIZATION_VERSION = 3


@dataclass(frozen=True)
class Names:
    """The Feast names of one feature set."""

    entity: str
    join_key: str
    feature_view: str
    push_source: str
    batch_source: str

    @classmethod
    def of(cls, fs: FeatureSet) -> Names:
        return cls(entity=fs.entity.name, join_key=fs.entity.join_key, feature_view=fs.name,
                   push_source=f"{fs.name}_push", batch_source=f"{fs.name}_batch")


#: The Int64 fields of every feature view: the window bounds (epoch ms) and the reading count.
INT_COLUMNS = ("window_start", "window_end", "count")


def feature_columns(fs: FeatureSet) -> tuple[str, ...]:
    """Every field of the feature view, in the order of the output record (key excluded)."""
    return (*INT_COLUMNS, *fs.feature_names)

#: ``feast.types.ValueType.Enum.STRING``: the type tag of a string join key and of its value.
VALUE_TYPE_STRING = 2


def _value_message() -> type:
    """``feast.types.Value`` (``protos/feast/types/Value.proto``), the scalar members of its ``val`` oneof.

    Declared here with protobuf's descriptor API, in a private pool, with Feast's field numbers:
    the bytes are Feast's, and a process that also loads Feast's own ``Value`` sees no clash.
    """
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="tangram/feast/value.proto", package="tangram.feast",
                                              syntax="proto3")
    message = file.message_type.add(name="Value")
    message.oneof_decl.add(name="val")
    for name, number, kind in (("bytes_val", 1, f.TYPE_BYTES), ("string_val", 2, f.TYPE_STRING),
                               ("int32_val", 3, f.TYPE_INT32), ("int64_val", 4, f.TYPE_INT64),
                               ("double_val", 5, f.TYPE_DOUBLE), ("float_val", 6, f.TYPE_FLOAT),
                               ("bool_val", 7, f.TYPE_BOOL), ("unix_timestamp_val", 8, f.TYPE_INT64)):
        message.field.add(name=name, number=number, type=kind, label=f.LABEL_OPTIONAL, oneof_index=0)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tangram.feast.Value"))


#: Feast's ``Value`` message (scalar members).
Value = _value_message()

# A Value holding only ``double_val`` serializes as its tag (field 5, wire type 1: 0x29) and the
# 8-byte little-endian double; decoding that form with struct is 6× faster than parsing the
# message and gives the same float (tests/unit/test_feast_layout.py). Any other form is parsed.
_DOUBLE_TAG = (5 << 3) | 1
_DOUBLE = struct.Struct("<d")
_U32 = struct.Struct("<I")
#: Reads many rows in one command: ``EVALSHA <sha> <n> key… field…`` → one ``HMGET`` reply per key.
#: One command per batch instead of one ``HMGET`` (33 arguments to pack) per key; same keys, same
#: fields, same bytes as Feast's pipelined ``HMGET``s (a single Redis, not a cluster: the keys of a
#: script must share a slot there).
HMGET_MANY = """
local rows = {}
for i, key in ipairs(KEYS) do rows[i] = redis.call('HMGET', key, unpack(ARGV)) end
return rows
"""
HMGET_MANY_SHA = hashlib.sha1(HMGET_MANY.encode()).hexdigest()
#: Writes many rows in one command, keeping Feast's newest-wins rule: ``EVALSHA <sha> <keys> key… [progress]
#: ttl m rows field… (ms cells)… [name value…]`` — for each of the ``rows`` keys, its row's event time in ms
#: and its ``m`` values in one string, each value after its length in one byte (``FeastLayout.pack_rows``:
#: two arguments a row, not ``m + 1``, since the client's cost is per argument: ~0.7 µs each in redis-py);
#: a row is written (``HSET`` of the ``m`` fields, the last being ``_ts``, then ``EXPIRE`` when ttl > 0)
#: only when the stored ``_ts`` (a ``google.protobuf.Timestamp``: field 1 seconds, field 2 nanos, varints)
#: is older. A key after the rows' is an engine's progress hash: the name/value pairs after the rows go
#: into it (``HSET``, and the same ``EXPIRE``) in the same script, so rows and progress are written
#: together or not at all. Returns how many rows were written.
HSET_NEWER = """
local function millis(b)
  local secs, nanos, i = 0, 0, 1
  while i <= #b do
    local tag = string.byte(b, i)
    local v, mul, c = 0, 1, 128
    i = i + 1
    while c >= 128 do
      c = string.byte(b, i)
      i = i + 1
      v = v + (c % 128) * mul
      mul = mul * 128
    end
    if tag == 8 then secs = v elseif tag == 16 then nanos = v end
  end
  return secs * 1000 + math.floor(nanos / 1000000)
end
local ttl, m, rows = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local written = 0
for i = 1, rows do
  local key = KEYS[i]
  local at = 4 + m + (i - 1) * 2
  local stored = redis.call('HGET', key, ARGV[3 + m])
  if (not stored) or millis(stored) < tonumber(ARGV[at]) then
    local cells, args, p = ARGV[at + 1], {}, 1
    for j = 1, m do
      local len = string.byte(cells, p)
      args[2 * j - 1] = ARGV[3 + j]
      args[2 * j] = string.sub(cells, p + 1, p + len)
      p = p + 1 + len
    end
    redis.call('HSET', key, unpack(args))
    if ttl > 0 then redis.call('EXPIRE', key, ttl) end
    written = written + 1
  end
end
local progress = KEYS[rows + 1]
local first = 4 + m + rows * 2
if progress and #ARGV >= first then
  for i = first, #ARGV, 7000 do
    redis.call('HSET', progress, unpack(ARGV, i, math.min(i + 6999, #ARGV)))
  end
  if ttl > 0 then redis.call('EXPIRE', progress, ttl) end
end
return written
"""
HSET_NEWER_SHA = hashlib.sha1(HSET_NEWER.encode()).hexdigest()
#: Feast's project names: letters, digits, ``_`` and ``-`` (``feast.repo_operations.is_valid_name``).
_NOT_NAME = re.compile(r"[^\w-]")


def field_hash(feature_view: str, feature: str) -> bytes:
    """Feast's hash field of a feature: murmur3 32-bit of ``<view>:<feature>``, unsigned, little-endian."""
    return _U32.pack(mmh3.hash(f"{feature_view}:{feature}", signed=False))


@functools.lru_cache(maxsize=1 << 18)
def entity_key(join_key: str, entity_id: str,
               version: int = ENTITY_KEY_SERIALIZATION_VERSION) -> bytes:
    """Feast's ``serialize_entity_key`` of one string join key (serialization version 3); the keys of the
    last 262,144 entities asked are kept (the rule processor asks for a batch's entities every batch)."""
    if version != 3:
        raise ValueError(f"entity_key_serialization_version {version} is not supported: Feast 0.67 writes 3")
    k, v = join_key.encode(), entity_id.encode()
    return b"".join((_U32.pack(1), _U32.pack(VALUE_TYPE_STRING), _U32.pack(len(k)), k,
                     _U32.pack(VALUE_TYPE_STRING), _U32.pack(len(v)), v))


def encode_value(value: float | int | None, *, integer: bool) -> bytes:
    """A serialized ``Value``: ``int64_val`` or ``double_val``; ``None`` is Feast's null (the empty message)."""
    if value is None:
        return b""
    return Value(int64_val=int(value)).SerializeToString() if integer else \
        Value(double_val=float(value)).SerializeToString()


def decode_value(data: bytes | None) -> float | int | str | bool | None:
    """The Python value of a serialized ``Value`` (``None`` for a missing field or Feast's null)."""
    if not data:
        return None
    if len(data) == 9 and data[0] == _DOUBLE_TAG:
        return _DOUBLE.unpack_from(data, 1)[0]
    message = Value.FromString(data)
    kind = message.WhichOneof("val")
    return None if kind is None else getattr(message, kind)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a 64-bit integer (a negative one as its two's complement, 10 bytes)."""
    return varint(value & 0xFFFF_FFFF_FFFF_FFFF)


_INT64_TAG = bytes([(4 << 3) | 0])  # int64_val, varint


@functools.lru_cache(maxsize=16_384)
def _int64_value(value: int) -> bytes:
    """``encode_value(value, integer=True)`` without the message object (the batch writer's path). Cached: the
    rows of a flush share their window bounds (aligned windows) and mostly their counts."""
    return _INT64_TAG + _varint(int(value))


def _prefixed(values) -> bytes:
    """Serialized values, each after its length in one byte (a ``Value`` or ``Timestamp`` is at most 14)."""
    return b"".join(bytes((len(v),)) + v for v in values)


@functools.lru_cache(maxsize=16_384)
def _timestamp(epoch_ms: int) -> bytes:
    """``encode_timestamp`` without the message object: seconds (field 1) and nanos (field 2), zeros omitted.
    Cached, as ``_int64_value``: a flush's rows share their windows' end times."""
    seconds, millis = divmod(int(epoch_ms), 1000)
    return (b"\x08" + _varint(seconds) if seconds else b"") + (b"\x10" + _varint(millis * 1_000_000) if millis else b"")


@functools.lru_cache(maxsize=16_384)
def _int_head(values: tuple[int | None, ...]) -> bytes:
    """The integer fields of a packed row (``pack_columns``). Cached: a batch's windows share their bounds and
    mostly their counts."""
    return _prefixed(_int64_value(v) if v is not None else b"" for v in values)


@functools.lru_cache(maxsize=16_384)
def _time_tail(epoch_ms: int) -> bytes:
    """The event time that ends a packed row (``pack_columns``), cached as its integer fields are."""
    return _prefixed((_timestamp(epoch_ms),))


def encode_timestamp(epoch_ms: int) -> bytes:
    """The serialized ``google.protobuf.Timestamp`` of an epoch time in milliseconds."""
    ts = Timestamp()
    ts.FromMilliseconds(int(epoch_ms))
    return ts.SerializeToString()


def decode_timestamp_ns(data: bytes | None) -> int:
    """Nanoseconds since the epoch of a serialized ``Timestamp`` (0 when absent, as Feast treats it)."""
    if not data:
        return 0
    ts = Timestamp.FromString(data)
    return ts.seconds * 1_000_000_000 + ts.nanos


@dataclass(frozen=True)
class FeastLayout:
    """Where one feature view of one Feast project lives in Redis, and how its rows are encoded.

    ``FeastLayout.of(feature_set, project)`` is the layout of a declared feature set; ``key``,
    ``encode_row`` and ``decode_row`` are its three operations, ``read_fields`` what an ``HMGET``
    asks for (every field of the view, then its ``_ts``).
    """

    project: str
    feature_view: str
    join_key: str
    int_fields: tuple[str, ...]
    double_fields: tuple[str, ...]
    key_ttl_s: int | None
    event_time_field: str = EVENT_TIME_COLUMN
    serialization_version: int = ENTITY_KEY_SERIALIZATION_VERSION

    @classmethod
    def of(cls, fs: FeatureSet, project: str) -> FeastLayout:
        names = Names.of(fs)
        return cls(project=project, feature_view=names.feature_view, join_key=names.join_key,
                   int_fields=INT_COLUMNS, double_fields=tuple(fs.feature_names), key_ttl_s=fs.online.ttl_s)

    def __post_init__(self) -> None:
        if not self.project or self.project.startswith(("_", "-")) or _NOT_NAME.search(self.project):
            raise ValueError(f"Feast project {self.project!r}: use letters, digits, '_' and '-', not starting "
                             "with '_' or '-' (Feast's rule)")
        if self.event_time_field not in self.int_fields:
            raise ValueError(f"event time field {self.event_time_field!r} is not one of {self.int_fields}")

    def __getstate__(self) -> dict:
        """Pickle the declared fields only (the cached encodings are rebuilt on use)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @cached_property
    def fields(self) -> tuple[str, ...]:
        """Every field of the view, Int64 ones first, in the output record's order."""
        return (*self.int_fields, *self.double_fields)

    @cached_property
    def ts_field(self) -> bytes:
        return f"_ts:{self.feature_view}".encode()

    @cached_property
    def hashes(self) -> dict[str, bytes]:
        return {name: field_hash(self.feature_view, name) for name in self.fields}

    @cached_property
    def read_fields(self) -> list[bytes]:
        """The hash fields an ``HMGET`` of a whole row asks for: every field of the view, then ``_ts``."""
        return [*(self.hashes[n] for n in self.fields), self.ts_field]

    @cached_property
    def _project(self) -> bytes:
        return self.project.encode()

    @cached_property
    def _integer(self) -> frozenset[str]:
        return frozenset(self.int_fields)

    def key(self, entity_id: str) -> bytes:
        """The Redis key of an entity: Feast's serialized entity key, then the project."""
        return entity_key(self.join_key, entity_id, self.serialization_version) + self._project

    def keys(self, entity_ids: Sequence[str]) -> list[bytes]:
        """:meth:`key` of each of ``entity_ids``; the keys of the last 262,144 entities asked are kept (the
        rule processor asks for a batch's entities every batch: one dict lookup each, not a call)."""
        cache = self._keys
        if len(cache) > 1 << 18:
            cache.clear()
        out = list(map(cache.get, entity_ids))
        if None in out:
            for i, (entity, got) in enumerate(zip(entity_ids, out)):
                if got is None:
                    got = cache[entity] = out[i] = self.key(entity)
        return out

    @cached_property
    def _keys(self) -> dict[str, bytes]:
        return {}

    def event_time_ms(self, row: Mapping) -> int:
        return int(row[self.event_time_field])

    def encode_row(self, row: Mapping) -> dict[bytes, bytes]:
        """The hash fields of a row (its view's fields, ``_ts``); other keys of ``row`` are ignored."""
        integer = self._integer
        mapping = {self.hashes[n]: encode_value(row.get(n), integer=n in integer) for n in self.fields}
        mapping[self.ts_field] = encode_timestamp(self.event_time_ms(row))
        return mapping

    def pack_rows(self, rows: Sequence[Mapping]) -> list[bytes]:
        """Each row's values for ``read_fields`` (the view's fields, then ``_ts``: the bytes of ``encode_row``)
        in one string, each value after its length in one byte, as ``HSET_NEWER`` reads them; the doubles of
        all rows encoded at once (:meth:`pack_columns`)."""
        n, k = len(rows), len(self.double_fields)
        doubles = np.array([[row[f] for f in self.double_fields] for row in rows], dtype="<f8").reshape(n, k)
        ints = [[row.get(f) for row in rows] for f in self.int_fields]
        out = self.pack_columns(ints, doubles, [self.event_time_ms(row) for row in rows])
        maybe_null = np.isnan(doubles).any(axis=1).tolist()  # a None became NaN above (a NaN may be a value)
        for i, row in enumerate(rows):
            if maybe_null[i] and any(row.get(f) is None for f in self.double_fields):  # Feast's null: the empty message
                packed = _prefixed(encode_value(row.get(f), integer=False) for f in self.double_fields)
                out[i] = b"".join((_int_head(tuple(row.get(f) for f in self.int_fields)), packed,
                                   _time_tail(self.event_time_ms(row))))
        return out

    def pack_columns(self, ints: Sequence[Sequence[int | None]], doubles: np.ndarray,
                     event_ms: Sequence[int]) -> list[bytes]:
        """:meth:`pack_rows` of rows given as columns: ``ints`` in ``int_fields`` order (None: Feast's null),
        ``doubles`` rows × ``double_fields`` (every value a double, NaN included), each row's event time. The
        feature engine stages a batch's windows this way, without a dict a window."""
        n, k = len(doubles), len(self.double_fields)
        cells = np.empty((n, k, 10), dtype=np.uint8)
        cells[:, :, 0] = 9  # the length of a double_val Value: its tag and 8 bytes
        cells[:, :, 1] = _DOUBLE_TAG
        cells[:, :, 2:] = np.ascontiguousarray(doubles, dtype="<f8").reshape(n, k).view(np.uint8).reshape(n, k, 8)
        blob, width = cells.tobytes(), 10 * k
        columns = [c.tolist() if isinstance(c, np.ndarray) else list(c) for c in ints]
        times = event_ms.tolist() if isinstance(event_ms, np.ndarray) else list(event_ms)
        heads = zip(*columns) if columns else [()] * n
        return [b"".join((_int_head(values), blob[i * width:(i + 1) * width], _time_tail(times[i])))
                for i, values in enumerate(heads)]

    @cached_property
    def _doubles(self) -> tuple[struct.Struct, list[int], bytes, slice]:
        """All double fields at once: when each value is the 9-byte ``double_val`` form, one unpack reads them."""
        n, first = len(self.double_fields), len(self.int_fields)
        return struct.Struct("<" + "xd" * n), [9] * n, bytes([_DOUBLE_TAG]) * n, slice(first, first + n)

    def decode_doubles(self, replies: Sequence[Sequence[bytes | None]], name: str) -> tuple[np.ndarray, np.ndarray]:
        """Double field ``name`` of every row read by ``HMGET``s of ``read_fields``, as one array, and where it is
        a plain double (False where the entity has no row, the value is Feast's null or another encoding)."""
        at = len(self.int_fields) + self.double_fields.index(name)
        cells = [values[at] if values[-1] is not None else None for values in replies]
        valid = np.fromiter((c is not None and len(c) == 9 and c[0] == _DOUBLE_TAG for c in cells), dtype=bool,
                            count=len(cells))
        out = np.zeros(len(cells), dtype=np.float64)
        if valid.any():
            joined = np.frombuffer(b"".join(c for c, ok in zip(cells, valid) if ok), dtype=np.uint8)
            out[valid] = joined.reshape(-1, 9)[:, 1:].copy().view("<f8").reshape(-1)
        return out, valid

    @staticmethod
    def has_row(values: Sequence[bytes | None]) -> bool:
        """Whether an ``HMGET`` of ``read_fields`` found a row: its ``_ts``, read last, is there."""
        return values[-1] is not None

    def decode_row(self, values: Sequence[bytes | None]) -> dict[str, float | int | None]:
        """The row read by an ``HMGET`` of ``read_fields`` (``{}`` when the entity has no row in this view)."""
        if not self.has_row(values):
            return {}
        row = {name: decode_value(data) for name, data in zip(self.int_fields, values)}
        many, nines, tags, at = self._doubles
        doubles = values[at]
        if None not in doubles and list(map(len, doubles)) == nines and (joined := b"".join(doubles))[0::9] == tags:
            row.update(zip(self.double_fields, many.unpack(joined)))  # the hot path of reads: one C call
        else:  # a null or another encoding somewhere: field by field
            row.update((name, decode_value(data)) for name, data in zip(self.double_fields, doubles))
        return row
