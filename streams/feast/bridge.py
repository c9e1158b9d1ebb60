"""Backfill: the features topic into Feast's online store, through Feast's own push.

The engines write Feast's Redis store themselves (``streams.features.layout``), so this is not
on the live path: it refills the store from the topic when Redis is new or was emptied, or for
rows from an engine run without an online store. Feast's writer and the engines' write the same
bytes and keep the same rule (the newest ``window_end`` wins), so the two can run side by side.

Consumes the output topic of a feature set (Confluent-framed Avro: magic byte 0, 4-byte schema
id, Avro binary; the writer schema fetched once per id from the registry's REST API,
``GET /schemas/ids/{id}``), keeps the newest row of each entity in a micro-batch, and pushes it
with Feast's own API (``FeatureStore.push(<feature set>_push, frame, to=PushMode.ONLINE)``).
Offsets are committed (manually, synchronously) only after the push returned, so a crash
re-pushes the last batch: harmless, Feast's Redis store keeps the row with the newest event
time (``window_end``) and skips older or equal ones.

A record that cannot be decoded stops the bridge with an error and nothing of its batch
committed: the features topic is written by Tangram's own engines, so such a record is a bug
to look at, not data to skip.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass


from streams.errors import SchemaError
from streams.security.kafka import KafkaConnection
from streams.features.spec import FeatureSet
from streams.wire import RegistryREST, WireCodec
from streams.feast.repo import EVENT_TIMESTAMP
from streams.features.layout import EVENT_TIME_COLUMN, INT_COLUMNS, Names, feature_columns

log = logging.getLogger("tangram.feast.sync")

@dataclass
class SyncStats:
    records: int = 0
    pushed_rows: int = 0
    batches: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"records": self.records, "pushed_rows": self.pushed_rows, "batches": self.batches,
                "seconds": round(self.seconds, 3)}


def newest_rows(fs: FeatureSet, records: list[dict]) -> list[dict]:
    """The newest row (by ``window_end``) of each entity among ``records``, as Feast push rows."""
    key = fs.entity.join_key
    newest: dict[str, dict] = {}
    for rec in records:
        cur = newest.get(rec[key])
        if cur is None or rec["window_end"] >= cur["window_end"]:
            newest[rec[key]] = rec
    return [{key: rec[key], **{c: rec[c] for c in feature_columns(fs)}} for rec in newest.values()]


def to_frame(fs: FeatureSet, rows: list[dict]):
    import pandas as pd

    frame = pd.DataFrame(rows, columns=[fs.entity.join_key, *feature_columns(fs)])
    frame[EVENT_TIMESTAMP] = pd.to_datetime(frame[EVENT_TIME_COLUMN], unit="ms", utc=True)
    for c in INT_COLUMNS:
        frame[c] = frame[c].astype("int64")
    for c in fs.feature_names:
        frame[c] = frame[c].astype("float64")
    return frame


def sync(fs: FeatureSet, *, repo: str, kafka: KafkaConnection, registry: str, topic: str, group: str,
         batch: int = 1000, poll_s: float = 0.5, until_idle_s: float | None = None,
         max_records: int | None = None) -> SyncStats:
    """Push the rows of ``topic`` into Feast's online store until idle, ``max_records`` or SIGTERM."""
    from confluent_kafka import Consumer, KafkaError
    from feast import FeatureStore
    from feast.data_source import PushMode

    store = FeatureStore(repo_path=repo)
    push_source = Names.of(fs).push_source
    store.get_data_source(push_source)  # fails now, with Feast's message, if `apply` has not run
    codec = WireCodec(RegistryREST(registry), fs.output.schema_)  # any writer id, read as the newest schema
    consumer = Consumer(kafka.config({
        "group.id": group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    }))
    stats = SyncStats()
    stopping = threading.Event()
    if threading.current_thread() is threading.main_thread():  # SIGTERM: finish the batch, commit, close
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    start = last = time.monotonic()
    try:
        consumer.subscribe([topic])
        while (max_records is None or stats.records < max_records) and not stopping.is_set():
            want = batch if max_records is None else min(batch, max_records - stats.records)
            messages = consumer.consume(num_messages=want, timeout=poll_s)
            records = []
            for msg in messages:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RuntimeError(f"consume from {topic} failed: {err}")
                try:
                    records.append(codec.decode(msg.value()))
                except Exception as exc:
                    raise SchemaError(f"{topic}[{msg.partition()}]@{msg.offset()}: cannot decode: "
                                      f"{type(exc).__name__}: {exc}; nothing of this batch committed") from exc
            if not messages:
                if until_idle_s is not None and time.monotonic() - last >= until_idle_s:
                    break
                continue
            last = time.monotonic()
            if records:
                rows = newest_rows(fs, records)
                store.push(push_source, to_frame(fs, rows), to=PushMode.ONLINE)
                stats.pushed_rows += len(rows)
                stats.records += len(records)
            consumer.commit(asynchronous=False)  # only after the push returned
            stats.batches += 1
            log.info("pushed %d rows from %d records", stats.pushed_rows, stats.records)
    finally:
        consumer.close()
        stats.seconds = time.monotonic() - start
    return stats


def get_online(repo: str, fs: FeatureSet, entity_ids: list[str]) -> list[dict]:
    """Feast's online read of every field of ``fs`` for ``entity_ids`` (``None`` where unknown)."""
    from feast import FeatureStore

    store = FeatureStore(repo_path=repo)
    fv = Names.of(fs).feature_view
    key = fs.entity.join_key
    result = store.get_online_features(
        features=[f"{fv}:{c}" for c in feature_columns(fs)],
        entity_rows=[{key: e} for e in entity_ids],
    ).to_dict()
    return [{c: result[c][i] for c in (key, *feature_columns(fs))} for i in range(len(entity_ids))]
