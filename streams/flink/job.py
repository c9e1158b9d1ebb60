"""The feature set as a Flink SQL job: the JVM decodes, windows and aggregates; Python computes one feature.

Runs in the Flink environment (``.venv-flink``, apache-flink) on a local mini-cluster, or is submitted to
a Flink cluster (``flink run --python streams/flink/job.py ...``, ``streams.flink.cluster``). The query is
generated from the feature-set declaration:

1. **Source**: the ingest topic through Flink's Kafka connector, the value kept as raw bytes and decoded
   in the JVM by ``CONFLUENT_AVRO`` (``streams/flink/udf``: writer schemas from the registry by id; a flat
   record read straight into the row, any other through Flink's own avro-confluent deserializer) — raw so
   that a late or undecodable reading can reach the DLQ with its original bytes. The event time is a
   computed column; its watermark (event time minus the allowed lateness and 1 ms) is pushed into the
   Kafka source, so it is per partition, combined by minimum.
2. **Lateness, as the embedded engine decides it**: a partition's stream time is the running maximum of
   the event times read from it (``MAX(ts) OVER (PARTITION BY partition ORDER BY proctime)``, the
   partition's order); a reading whose window ends at or before stream time minus the allowed lateness
   is late — to the DLQ with reason ``late``, never dropped (an undecodable value, with no event time, takes
   the same path to the DLQ as ``undecodable``: the source feeds that one operator). The rest can never be
   late for Flink's window operator: its watermark is at most any partition's stream time minus lateness
   minus 1 ms, so no accepted reading arrives after its window fired (Flink's own late-row dropping never
   triggers).
3. **Windows**: Flink's tumbling window TVF, keyed by entity, with built-in aggregates: ``COUNT``,
   ``AVG``, ``MIN``, ``MAX``, ``SUM`` (the population standard deviation from the sums of values and of
   squares), ``LAST_VALUE`` (the newest reading's trace headers), and ``ARRAY_AGG`` of the event times and
   values the spectral feature needs.
4. **Python, vectorized**: ``band_energy`` (a pandas UDF over a batch of windows' arrays: one batched FFT
   per window length, ``streams.features.compute.band_energies``) and, with ``--redis``, the online
   store (a pandas UDF writing a batch of rows to Feast's Redis layout in one command; Feast's
   newest-wins rule makes a rewrite after a restore harmless).
5. **Sinks**: the features topic with Flink's avro-confluent format and the app's registered schema
   (``avro-confluent.schema``: the subject's id, the embedded engine's bytes), the DLQ topic raw.

Tumbling windows only: with hopping ones a reading can be late for some of its windows and not others,
which a filter in front of Flink's windows cannot express; the embedded engine computes those.

    python -m streams.flink.job --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081 --dlq pm.dlq.features \\
        --feature-set topologies/predictive_maintenance/features/device_window.yaml \\
        --jar <home>/flink/lib/... [--bounded] [--redis redis://127.0.0.1:6379/0 --project pm] [--parallelism 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from pyflink.common import Configuration
from pyflink.table import EnvironmentSettings, TableEnvironment

from streams.features.spec import FeatureSet, load_feature_set
from streams.flink.functions import band_energy_function, online_store_function
from streams.security.kafka import KafkaSecurity
from streams.wire import RegistryREST

log = logging.getLogger("tangram.flink")

UDF_CLASS = "dev.tangram.flink.ConfluentAvro"
STAGE = "features-flink"


def _interval(ms: int) -> str:
    return f"INTERVAL '{ms / 1000:.3f}' SECOND"


def _quote(text: str) -> str:
    return text.replace("'", "''")


def _with(options: dict[str, str]) -> str:
    return ", ".join(f"'{k}' = '{_quote(v)}'" for k, v in options.items())


def _connection(bootstrap: str, security: KafkaSecurity) -> dict[str, str]:
    """The Kafka connector's connection options: the bootstrap servers and this process's Kafka security
    (``TANGRAM_KAFKA_SECURITY``) for the connector jar's relocated client, as every client gets it."""
    return {"properties.bootstrap.servers": bootstrap,
            **{f"properties.{k}": str(v) for k, v in security.java(shaded=True).items()}}


def registry_format_options(prefix: str, registry: str) -> dict[str, str]:
    """The avro-confluent format's registry options: the URL, and its basic-auth user when the URL has one."""
    parts = urlsplit(registry)  # (streams.settings is not importable here: the Flink environment has no pydantic-settings)
    options = {f"{prefix}.url": urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))}
    if parts.username is not None:
        options.update({f"{prefix}.basic-auth.credentials-source": "USER_INFO",
                        f"{prefix}.basic-auth.user-info": f"{unquote(parts.username)}:{unquote(parts.password or '')}"})
    return options


def source_ddl(fs: FeatureSet, topic: str, bootstrap: str, registry: str, group: str, bounded: bool,
               security: KafkaSecurity | None = None) -> str:
    """The raw Kafka source with the decoded reading, its event time and a per-partition watermark."""
    w = fs.window
    fields = [f"`{fs.entity.join_key}` STRING", f"`{fs.source.timestamp_field}` BIGINT",
              *(f"`{name}` DOUBLE" for name in fs.inputs)]
    row = f"ROW<{', '.join(fields)}>"
    decoded = f"CONFLUENT_AVRO(v, '{_quote(row)}', '{_quote(registry)}')"
    options = {"connector": "kafka", "topic": topic, **_connection(bootstrap, security or KafkaSecurity()),
               "key.format": "raw", "key.fields": "k", "value.format": "raw", "value.fields-include": "EXCEPT_KEY",
               "properties.group.id": group, "scan.startup.mode": "group-offsets",
               "properties.auto.offset.reset": "earliest", "properties.isolation.level": "read_committed"}
    if bounded:
        options["scan.bounded.mode"] = "latest-offset"
    return (f"CREATE TEMPORARY TABLE source (k STRING, v BYTES, headers MAP<STRING, BYTES> METADATA, "
            f"p INT METADATA FROM 'partition' VIRTUAL, o BIGINT METADATA FROM 'offset' VIRTUAL, "
            f"r AS {decoded}, "
            # an undecodable value has no event time: epoch 0 keeps the watermark where it is, and the row
            # goes to the DLQ before any window
            f"et AS TO_TIMESTAMP_LTZ(COALESCE({decoded}.`{fs.source.timestamp_field}`, 0), 3), "
            f"proc AS PROCTIME(), "
            f"WATERMARK FOR et AS et - {_interval(w.allowed_lateness_ms + 1)}) WITH ({_with(options)})")


_SQL_TYPES = {"string": "STRING", "double": "DOUBLE", "float": "FLOAT", "int": "INT", "long": "BIGINT",
              "boolean": "BOOLEAN"}


def _sql_type(avro: object) -> str:
    """The Flink SQL type of an Avro field type (a union with null: its other branch; a logical type: its base)."""
    if isinstance(avro, list):
        (avro,) = [t for t in avro if t != "null"]
    if isinstance(avro, dict):
        avro = avro["type"]
    if avro not in _SQL_TYPES:
        raise SystemExit(f"an entity table attribute of Avro type {avro!r}: only {sorted(_SQL_TYPES)} can be joined")
    return _SQL_TYPES[str(avro)]


def table_ddl(fs: FeatureSet, topic: str, table_schema: dict, bootstrap: str, registry: str, bounded: bool,
              security: KafkaSecurity | None = None) -> list[str]:
    """The entity table as a versioned view: the topic read as the log of its versions (each in effect from its
    record's Kafka timestamp, a tombstone a version with no attributes), the used attributes decoded in the JVM,
    and the newest version per entity by that time (Flink's versioned view over a deduplication). Not
    upsert-kafka: its changelog normalisation gives a tombstone's delete the time of the version it ends,
    which would end the entity from the start. An idle table does not hold the readings
    (``scan.watermark.idle-timeout``)."""
    assert fs.enrichment is not None
    types = {f["name"]: _sql_type(f["type"]) for f in table_schema["fields"]}
    if lacking := [a for a in fs.enrichment.used if a not in types]:
        raise SystemExit(f"feature set {fs.name}: table {topic!r} has no attribute(s) {lacking}")
    row = f"ROW<{', '.join(f'`{a}` {types[a]}' for a in fs.enrichment.used)}>"
    options = {"connector": "kafka", "topic": topic, **_connection(bootstrap, security or KafkaSecurity()),
               "key.format": "raw", "key.fields": "k", "value.format": "raw", "value.fields-include": "EXCEPT_KEY",
               "scan.startup.mode": "earliest-offset", "scan.watermark.idle-timeout": "1 s"}
    if bounded:
        options["scan.bounded.mode"] = "latest-offset"
    log_ddl = (f"CREATE TEMPORARY TABLE entity_log (k STRING, v BYTES, "
               f"vt TIMESTAMP_LTZ(3) METADATA FROM 'timestamp', "
               f"a AS CONFLUENT_AVRO(v, '{_quote(row)}', '{_quote(registry)}'), "
               f"WATERMARK FOR vt AS vt) WITH ({_with(options)})")
    versioned = ("CREATE TEMPORARY VIEW entity_table AS SELECT k, a, vt FROM (SELECT k, a, vt, ROW_NUMBER() OVER "
                 "(PARTITION BY k ORDER BY vt DESC) AS version FROM entity_log) WHERE version = 1")
    return [log_ddl, versioned]


def _literal(value: object) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, (int, float)):
        return repr(float(value)) if isinstance(value, float) else str(value)
    return f"'{_quote(str(value))}'"


def _attribute(fs: FeatureSet, name: str, table: str) -> str:
    """An attribute of the version joined as ``table`` (``<table>.a``), its default in its place when declared."""
    assert fs.enrichment is not None
    column = f"{table}.a.`{name}`"
    if fs.enrichment.missing == "defaults" and fs.enrichment.defaults.get(name) is not None:
        return f"COALESCE({column}, {_literal(fs.enrichment.defaults[name])})"
    return column


def sink_ddl(name: str, topic: str, bootstrap: str, value: dict[str, str], columns: str, exactly_once: bool,
             security: KafkaSecurity | None = None) -> str:
    options = {"connector": "kafka", "topic": topic, **_connection(bootstrap, security or KafkaSecurity()),
               "key.format": "raw", "key.fields": "k", "value.fields-include": "EXCEPT_KEY", **value,
               "sink.delivery-guarantee": "exactly-once" if exactly_once else "at-least-once"}
    if exactly_once:
        options["sink.transactional-id-prefix"] = f"tangram-{name}-{topic}"
    else:
        options.update({"properties.enable.idempotence": "true", "properties.acks": "all"})
    return f"CREATE TEMPORARY TABLE `{name}` ({columns}) WITH ({_with(options)})"


def queries(fs: FeatureSet, source_topic: str, online: bool, table_topic: str | None = None) -> list[str]:
    """The views over the ``source`` table, then the INSERTs into the features and DLQ sinks (``table_topic``: the
    entity table's topic the job reads, named in the dead letters of unknown entities)."""
    w = fs.window
    key, ts = fs.entity.join_key, fs.source.timestamp_field
    # every record, the undecodable ones too (no event time: they move no partition's stream time): the source then
    # feeds one operator, not a second filter evaluated on every record in its thread for the rare undecodable one
    readings = (f"SELECT k, v, headers, p, o, r, et, r.`{ts}` AS ts, r IS NULL AS undecodable, "
                f"MAX(r.`{ts}`) OVER (PARTITION BY p ORDER BY proc ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) "
                f"AS stream_time FROM source")
    late = f"ts - MOD(ts, {w.size_ms}) + {w.size_ms + w.allowed_lateness_ms} <= stream_time"
    timely = f"NOT undecodable AND NOT ({late})"
    columns = ", ".join(f"r.`{name}` AS `{name}`" for name in fs.inputs)
    accepted = f"SELECT r.`{key}` AS `{key}`, et, ts, headers, {columns} FROM readings WHERE {timely}"
    enrichment, views = fs.enrichment, []
    if enrichment is not None:
        # lateness first, as the embedded engine decides it; then each reading joins the version of its entity in
        # effect at its event time (an event-time temporal join), is dead-lettered unknown, filtered, or filled
        on_time = (f"SELECT k, v, headers, p, o, r.`{key}` AS `{key}`, et, ts, {columns} "
                   f"FROM readings WHERE {timely}")
        unknown = "FALSE" if enrichment.missing == "defaults" else "t.a IS NULL"  # none yet, or a tombstone
        kept = " AND ".join(f"{_attribute(fs, name, 't')} IN ({', '.join(_literal(v) for v in values)})"
                            for name, values in enrichment.keep.items()) or "TRUE"
        filled = ", ".join(f"COALESCE(o.`{name}`, CAST({_attribute(fs, enrichment.fill[name], 't')} AS DOUBLE)) "
                           f"AS `{name}`" if name in enrichment.fill else f"o.`{name}`" for name in fs.inputs)
        views.append(f"CREATE TEMPORARY VIEW on_time AS {on_time}")
        views.append(f"CREATE TEMPORARY VIEW joined AS SELECT o.k, o.v, o.headers, o.p, o.o, o.`{key}`, o.et, o.ts, "
                     f"{filled}, {unknown} AS `unknown_entity`, COALESCE({kept}, FALSE) AS `kept` FROM on_time AS o "
                     f"LEFT JOIN entity_table FOR SYSTEM_TIME AS OF o.et AS t ON o.`{key}` = t.k")
        inputs = ", ".join(f"`{name}`" for name in fs.inputs)
        accepted = f"SELECT `{key}`, et, ts, headers, {inputs} FROM joined WHERE NOT `unknown_entity` AND `kept`"
    selects = [f"`{key}`", "window_start", "window_end", "COUNT(*) AS `count`"]
    for agg in fs.aggregations:
        if agg.kind == "missing_rate":
            seen = " + ".join(f"COUNT(`{i}`)" for i in agg.inputs)
            selects.append(f"1.0 - CAST({seen} AS DOUBLE) / CAST(COUNT(*) * {len(agg.inputs)} AS DOUBLE) "
                           f"AS `missing_rate`")
        elif agg.kind == "stats":
            for i in agg.inputs:
                n, s, q = f"COUNT(`{i}`)", f"SUM(`{i}`)", f"SUM(`{i}` * `{i}`)"
                stat = {"mean": f"AVG(`{i}`)", "min": f"MIN(`{i}`)", "max": f"MAX(`{i}`)",
                        "ptp": f"MAX(`{i}`) - MIN(`{i}`)",
                        "std": f"SQRT(GREATEST(({q} - {s} * {s} / {n}) / {n}, 0.0))"}
                selects += [f"COALESCE({stat[name]}, 0.0) AS `{i}_{name}`" for name in agg.stats]
        else:
            selects.append(f"band_energy_{agg.inputs[0]}(ARRAY_AGG(ts), ARRAY_AGG(`{agg.inputs[0]}`)) "
                           f"AS `{agg.inputs[0]}_band_energy`")
    selects += [f"MIN(ts - MOD(ts, {w.size_ms})) AS start_ms",  # the window's start in epoch ms, exactly
                "LAST_VALUE(headers['trace_id']) AS trace_id", "LAST_VALUE(headers['ingest_ms']) AS ingest_ms"]
    windows = (f"SELECT {', '.join(selects)} FROM TABLE(TUMBLE(TABLE accepted_readings, DESCRIPTOR(et), "
               f"{_interval(w.size_ms)})) GROUP BY `{key}`, window_start, window_end")
    if enrichment is not None and enrichment.attributes:
        # each window with the attributes in effect at its last instant (window_time: its end minus 1 ms)
        encoded = []
        for attribute in enrichment.attributes:
            value = _attribute(fs, attribute.name, "t")
            if attribute.one_hot is None:
                encoded.append(f"COALESCE(CAST({value} AS DOUBLE), CAST('NaN' AS DOUBLE)) AS `{attribute.name}`")
            else:
                encoded += [f"CASE WHEN {value} = {_literal(v)} THEN 1.0 ELSE 0.0 END AS `{n}`"
                            for v, n in zip(attribute.one_hot, attribute.names())]
        timed = (f"SELECT {', '.join(selects)}, window_time FROM TABLE(TUMBLE(TABLE accepted_readings, "
                 f"DESCRIPTOR(et), {_interval(w.size_ms)})) GROUP BY `{key}`, window_start, window_end, window_time")
        windows = (f"SELECT w.*, {', '.join(encoded)} FROM ({timed}) AS w "
                   f"LEFT JOIN entity_table FOR SYSTEM_TIME AS OF w.window_time AS t ON w.`{key}` = t.k")
    start, end = "start_ms", f"start_ms + {w.size_ms}"
    features = ", ".join(f"`{n}`" for n in fs.feature_names)
    count = f"online_store(`{key}`, {start}, {end}, `count`, {features})" if online else "`count`"
    event_id = f"CAST(CONCAT(`{key}`, ':', CAST({start} AS STRING)) AS BYTES)"
    headers = (f"MAP['event_id', {event_id}, 'trace_id', COALESCE(trace_id, CAST('' AS BYTES)), "
               f"'ingest_ms', COALESCE(ingest_ms, CAST('' AS BYTES))]")
    insert_features = (f"INSERT INTO features SELECT `{key}` AS k, `{key}`, CAST(window_start AS TIMESTAMP(3)), "
                       f"CAST(window_end AS TIMESTAMP(3)), CAST({count} AS INT), {features}, {headers} "
                       f"FROM ({windows})")
    dead = (f"MAP['dlq.stage', CAST('{STAGE}' AS BYTES), 'dlq.reason', CAST(reason AS BYTES), "
            f"'dlq.error_class', CAST('Rejected' AS BYTES), 'dlq.error_message', CAST(message AS BYTES), "
            f"'dlq.source_topic', CAST('{_quote(source_topic)}' AS BYTES), "
            f"'dlq.source_partition', CAST(CAST(p AS STRING) AS BYTES), "
            f"'dlq.source_offset', CAST(CAST(o AS STRING) AS BYTES), "
            f"'dlq.failed_ms', CAST(CAST(UNIX_TIMESTAMP() * 1000 AS STRING) AS BYTES)]")
    # one select for both reasons: one more operator on the readings, not two
    rejected = (f"SELECT k, v, headers, p, o, CASE WHEN undecodable THEN CAST('undecodable' AS STRING) "
                f"ELSE CAST('late' AS STRING) END AS reason, "
                f"CASE WHEN undecodable THEN 'not Confluent-framed Avro of the source schema' ELSE CONCAT("
                f"'reading at ', CAST(ts AS STRING), ' is late: its windows are already closed') END AS message "
                f"FROM readings WHERE undecodable OR ({late})")
    if enrichment is not None:  # the embedded engine's words: <key> <entity> has no version in table <t> at <ts>
        rejected += (" UNION ALL SELECT k, v, headers, p, o, 'unknown_entity' AS reason, "
                     f"CONCAT('{key} ', `{key}`, ' has no version in table {_quote(table_topic or enrichment.table)} at ', "
                     "CAST(ts AS STRING)) AS message FROM joined WHERE `unknown_entity`")
    insert_dlq = f"INSERT INTO dlq SELECT k, v, MAP_UNION(headers, {dead}) FROM ({rejected})"
    return [f"CREATE TEMPORARY VIEW readings AS {readings}", *views,
            f"CREATE TEMPORARY VIEW accepted_readings AS {accepted}", insert_features, insert_dlq]


def build_job(t_env: TableEnvironment, args: argparse.Namespace) -> None:
    fs = load_feature_set(args.feature_set)
    if fs.window.hop_ms != fs.window.size_ms:
        raise SystemExit(f"feature set {fs.name}: the Flink job computes tumbling windows; hop_ms {fs.window.hop_ms} "
                         f"!= size_ms {fs.window.size_ms} (the embedded engine computes hopping windows)")
    source_topic = args.source or fs.source.topic
    output_topic = args.output or fs.output.topic
    security = KafkaSecurity.from_environ(os.environ)  # TANGRAM_KAFKA_SECURITY, as every client reads it
    registry = RegistryREST(args.registry)
    output_schema = registry.latest(fs.output.schema_)  # the contract as `tangram apply` registered it
    t_env.execute_sql(f"CREATE TEMPORARY FUNCTION CONFLUENT_AVRO AS '{UDF_CLASS}' LANGUAGE JAVA")
    for agg in fs.aggregations:
        if agg.kind == "band_energy":
            t_env.create_temporary_function(f"band_energy_{agg.inputs[0]}",
                                            band_energy_function(fs.sample_hz, float(agg.cut_hz)))
    if args.redis:
        t_env.create_temporary_function("online_store", online_store_function(fs, args.redis, args.project))
    t_env.execute_sql(source_ddl(fs, source_topic, args.bootstrap, args.registry, args.group, args.bounded,
                                 security))
    table_topic = (args.table or fs.enrichment.table) if fs.enrichment is not None else None
    if fs.enrichment is not None:
        for statement in table_ddl(fs, table_topic, registry.latest(fs.enrichment.schema_),
                                   args.bootstrap, args.registry, args.bounded, security):
            t_env.execute_sql(statement)
    # NOT NULL: the contract's fields are (Flink checks the table against the schema it is given)
    fields = [f"`{fs.entity.join_key}` STRING NOT NULL", "window_start TIMESTAMP(3) NOT NULL",
              "window_end TIMESTAMP(3) NOT NULL", "`count` INT NOT NULL", *(f"`{n}` DOUBLE NOT NULL" for n in fs.feature_names)]
    t_env.execute_sql(sink_ddl("features", output_topic, args.bootstrap, {
        "value.format": "avro-confluent", **registry_format_options("value.avro-confluent", args.registry),
        "value.avro-confluent.subject": fs.output.schema_,
        "value.avro-confluent.schema": json.dumps(output_schema),
    }, f"k STRING, {', '.join(fields)}, headers MAP<STRING, BYTES> METADATA", args.exactly_once, security))
    t_env.execute_sql(sink_ddl("dlq", args.dlq, args.bootstrap, {"value.format": "raw"},
                               "k STRING, v BYTES, headers MAP<STRING, BYTES> METADATA", args.exactly_once, security))
    *views, insert_features, insert_dlq = queries(fs, source_topic, online=bool(args.redis), table_topic=table_topic)
    for view in views:
        t_env.execute_sql(view)
    statements = t_env.create_statement_set()
    statements.add_insert_sql(insert_features)
    statements.add_insert_sql(insert_dlq)
    result = statements.execute()
    if args.bounded or args.wait:
        result.wait()
    else:
        log.info("flink feature job submitted: %s", result.get_job_client().get_job_id())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="streams.flink.job", description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers.")
    p.add_argument("--registry", required=True, help="Schema registry URL.")
    p.add_argument("--jar", action="append", default=[], help="Jar(s) to add to the classpath (connector, UDF).")
    p.add_argument("--feature-set", required=True, help="Feature-set declaration (YAML).")
    p.add_argument("--source", help="Input topic (default: the feature set's).")
    p.add_argument("--output", help="Output topic (default: the feature set's).")
    p.add_argument("--table", help="The entity table's topic (default: the feature set's `enrichment.table`).")
    p.add_argument("--dlq", required=True, help="Dead-letter topic for late and undecodable readings.")
    p.add_argument("--group", default="pm.features-flink", help="Consumer group of the source.")
    p.add_argument("--redis", help="Online store (Feast's Redis layout), e.g. redis://127.0.0.1:6379/0; none: not written.")
    p.add_argument("--project", help="Feast project of the online store (the topology's app); needed with --redis.")
    p.add_argument("--bounded", action="store_true", help="Stop at the offsets that are latest at start (tests, backfills).")
    p.add_argument("--wait", action="store_true", help="Wait for an unbounded job (a mini-cluster run) instead of "
                                                       "returning once it is submitted.")
    p.add_argument("--parallelism", type=int, default=1)
    p.add_argument("--checkpoint-ms", type=int, default=10_000, help="Checkpoint interval (0: none).")
    p.add_argument("--checkpoint-dir", help="Where checkpoints go (a file:// URI; default: the cluster's).")
    p.add_argument("--exactly-once", action="store_true", help="Transactional Kafka sinks (readers: read_committed).")
    args = p.parse_args(argv)
    if args.redis and not args.project:
        p.error("--redis needs --project: the Feast project the online store's rows belong to (the topology's app)")
    return args


def configuration(args: argparse.Namespace) -> Configuration:
    config = Configuration()
    config.set_string("python.executable", sys.executable)
    config.set_string("python.client.executable", sys.executable)
    config.set_string("python.fn-execution.bundle.size", "1000")
    config.set_string("python.fn-execution.arrow.batch.size", "1000")
    config.set_string("pipeline.name", f"tangram-features-{Path(args.feature_set).stem}")
    config.set_string("parallelism.default", str(args.parallelism))
    config.set_string("table.local-time-zone", "UTC")  # window bounds as epoch ms, whatever the machine's zone
    # one-phase aggregation: a window's rows reach ARRAY_AGG and LAST_VALUE in their partition's order
    config.set_string("table.optimizer.agg-phase-strategy", "ONE_PHASE")
    # chained operators hand records on without copying them: CONFLUENT_AVRO's calls on one record (the
    # watermark's in the source, the query's after it) see the same bytes and decode them once
    config.set_string("pipeline.object-reuse", "true")
    if args.jar:
        config.set_string("pipeline.jars", ";".join(Path(j).resolve().as_uri() for j in args.jar))
    if args.checkpoint_ms and not args.bounded:
        config.set_string("execution.checkpointing.interval", f"{args.checkpoint_ms} ms")
        config.set_string("execution.checkpointing.mode", "EXACTLY_ONCE")
        if args.checkpoint_dir:
            config.set_string("execution.checkpointing.dir", args.checkpoint_dir)
    return config


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    t_env = TableEnvironment.create(EnvironmentSettings.new_instance().in_streaming_mode()
                                    .with_configuration(configuration(args)).build())
    started = time.monotonic()
    build_job(t_env, args)
    log.info("flink feature job done in %.1fs", time.monotonic() - started)


if __name__ == "__main__":
    main()
