"""The feature set as a Faust app (faust-streaming): an embedded engine with changelog-backed state.

One agent reads the source topic (Confluent-framed Avro, keyed by entity); the per-entity
event-time state (``streams.features.compute.EntityWindows``: open windows, watermark, newest
window emitted) lives in a Faust ``Table`` whose changelog topic
(``<group>-entity_windows-changelog``) restores it when a worker restarts.

Why a plain table and not Faust's ``.tumbling()`` window sets: Faust closes windows on one
stream-time clock for the whole table and expires them by wall time, while the declared
semantics close a window when *its entity's* newest event time passes its end plus the
allowed lateness. Keeping the shared state machine in a changelogged table gives identical
rows to the other engines (``tests/integration/test_parity.py``) and Faust's recovery.

Delivery: a window's output record is acknowledged by the broker before the state that
says "emitted" is written to the table, and the state remembers the offset of the last
reading applied, so a reading re-delivered after a crash is not counted twice: outputs may
repeat (same ``event_id``), never go missing. Late readings go to the DLQ topic. The newest row
of each entity goes to the online store, Feast's Redis store (``streams.features.layout``), under
the Feast project ``--project``.

    python -m streams.features.faust_job --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081 \\
        --redis redis://127.0.0.1:6379/0 --source pm.ingest.telemetry --output pm.features.device_window \\
        --dlq pm.dlq.features --group pm.features-faust --project pm
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import math
import time

import faust

from streams.avro import codec
from streams.settings import StackSettings
from streams.wire import WireFormatError
from streams.features.compute import EntityWindows, OpenWindow, output_row
from streams.features.layout import FeastLayout
from streams.features.online import OnlineWriter
from streams.features.spec import load_feature_set

log = logging.getLogger("tangram.features.faust")

CARRIED = ("event_id", "trace_id", "ingest_ms")


def encode_state(state: EntityWindows, applied: dict[int, int]) -> bytes:
    """An entity's window state as JSON for the changelog: plain data, so reading it back runs no code.

    (It was a pickle: bytes from a topic that anyone able to write the changelog could turn into
    code run here.) Header values are bytes, so they travel base64-encoded; NaN (a missing reading)
    is JSON's ``NaN`` extension, which Python's json reads back.
    """
    return json.dumps({
        "watermark": state.watermark, "emitted_end": state.emitted_end,
        "applied": {str(p): o for p, o in applied.items()},
        "open": [{"start": w.start, "ts": w.ts, "rows": w.rows,
                  "last": {k: base64.b64encode(v).decode() for k, v in (w.last or {}).items() if v is not None}}
                 for w in state.open.values()],
    }, separators=(",", ":")).encode()


def decode_state(data: bytes, state: EntityWindows) -> dict[int, int]:
    """Restore ``state`` from :func:`encode_state`'s bytes; returns the last offset applied per partition.

    ``ValueError`` (including a JSON error) for bytes that are not such a state.
    """
    saved = json.loads(data)
    state.watermark, state.emitted_end = int(saved["watermark"]), int(saved["emitted_end"])
    state.open = {}
    for w in saved["open"]:
        window = OpenWindow(int(w["start"]), None, [int(t) for t in w["ts"]], [[float(x) for x in r] for r in w["rows"]])
        window.last = {str(k): base64.b64decode(v, validate=True) for k, v in w["last"].items()} or None
        state.open[window.start] = window
    return {int(p): int(o) for p, o in saved["applied"].items()}


def broker_credentials() -> faust.SASLCredentials | None:
    """Faust's credentials from this process's Kafka security (``TANGRAM_KAFKA_SECURITY``), as every client's."""
    auth = StackSettings().kafka.security.aiokafka()
    if auth["security_protocol"] == "PLAINTEXT":
        return None
    return faust.SASLCredentials(username=auth["sasl_plain_username"], password=auth["sasl_plain_password"],
                                 mechanism=auth["sasl_mechanism"], ssl_context=auth["ssl_context"])


def build_app(args: argparse.Namespace) -> faust.App:
    """The Faust app of one feature set: source agent, state table, output and DLQ topics."""
    fs = load_feature_set(args.feature_set)
    in_codec = codec(args.registry, fs.source.schema_)  # the contracts as `tangram apply` registered them
    out_codec = codec(args.registry, fs.output.schema_)
    store = OnlineWriter(args.redis, FeastLayout.of(fs, args.project))
    app = faust.App(
        args.group, broker=f"kafka://{args.bootstrap}", store="memory://", web_enabled=False,
        topic_partitions=args.partitions, topic_replication_factor=1, consumer_auto_offset_reset="earliest",
        table_standby_replicas=0, stream_wait_empty=False, key_serializer="raw", value_serializer="raw",
        broker_credentials=broker_credentials(),
    )
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    source = app.topic(args.source, internal=False, **raw)
    output = app.topic(args.output, internal=False, **raw)
    dlq = app.topic(args.dlq, internal=False, **raw)
    table = app.Table("entity_windows", default=None, partitions=args.partitions, key_type=bytes, value_type=bytes)

    async def dead_letter(event: faust.types.EventT, reason: str, message: str) -> None:
        headers = {**dict(event.message.headers or ()),
                   "dlq.stage": b"features-faust", "dlq.reason": reason.encode(), "dlq.error_class": b"Rejected",
                   "dlq.error_message": message[:1000].encode(), "dlq.source_topic": event.message.topic.encode(),
                   "dlq.source_partition": str(event.message.partition).encode(),
                   "dlq.source_offset": str(event.message.offset).encode(),
                   "dlq.failed_ms": str(int(time.time() * 1000)).encode()}
        await (await dlq.send(key=event.key, value=event.value, headers=headers))

    @app.agent(source)
    async def windows(stream: faust.StreamT) -> None:
        async for event in stream.events():
            msg = event.message
            entity = event.key.decode("utf-8") if event.key is not None else ""
            saved = table.get(event.key)
            state = EntityWindows(fs)
            applied: dict[int, int] = {}
            if saved is None:
                (state.emitted_end,) = store.emitted_ends([entity])
            else:
                applied = decode_state(saved, state)
            if msg.offset <= applied.get(msg.partition, -1):
                continue  # re-delivered after a restart: already in the state
            try:
                reading = in_codec.decode(event.value)
            except WireFormatError as exc:
                await dead_letter(event, "undecodable", str(exc))
                continue
            row = [math.nan if reading[s] is None else reading[s] for s in fs.inputs]
            carried = {k: v for k, v in dict(msg.headers or ()).items() if k in CARRIED}
            accepted, closed = state.add(reading[fs.source.timestamp_field], row, None, carried)
            if not accepted:
                await dead_letter(event, "late", f"reading at {reading[fs.source.timestamp_field]} is late: "
                                                 "its windows are already closed")
            for window in closed:
                out = output_row(fs, entity, window)
                headers = {**(window["window"].last or {}), **carried, "event_id": f"{entity}:{window['start']}".encode()}
                await (await output.send(key=event.key, value=out_codec.encode(out), headers=headers))
                store.stage(out)
            if closed:
                store.flush()
            applied = {**applied, msg.partition: msg.offset}
            table[event.key] = encode_state(state, applied)

    return app


def command(python: str, *, bootstrap: str, registry: str, redis_url: str, project: str, source: str, output: str,
            dlq: str, group: str, feature_set: str) -> list[str]:
    """The command line of a worker of this app."""
    return [python, "-m", "streams.features.faust_job", "--bootstrap", bootstrap, "--registry", registry,
            "--redis", redis_url, "--project", project, "--source", source, "--output", output, "--dlq", dlq,
            "--group", group, "--feature-set", feature_set]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="streams.features.faust_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--registry", required=True)
    p.add_argument("--redis", required=True, help="Online store URL.")
    p.add_argument("--project", required=True,
                   help="Feast project of the online store (Feast's Redis layout), e.g. the topology's app.")
    p.add_argument("--feature-set", required=True, help="The feature-set declaration (YAML).")
    p.add_argument("--source", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--dlq", required=True)
    p.add_argument("--group", required=True, help="Faust app id: consumer group and changelog topic prefix.")
    p.add_argument("--partitions", type=int, default=3, help="Partitions of the source topic (the table's).")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    app = build_app(args)
    worker = faust.Worker(app, loglevel="WARNING", quiet=True)
    worker.execute_from_commandline()


if __name__ == "__main__":
    main()
