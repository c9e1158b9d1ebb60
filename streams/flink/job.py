"""The feature set as a PyFlink job: same declaration, same input topic, same output topic and schema.

Runs in the Flink environment (``.venv-flink``, apache-flink) on a local mini-cluster, or is
submitted to a Flink cluster (``flink run -py streams/flink/job.py``). Kafka in and out go
through Flink's Kafka connector (``flink-sql-connector-kafka`` from Maven Central,
``streams/flink/pom.xml``) with the ``raw`` format: values stay Confluent-framed Avro bytes,
decoded and encoded with fastavro against the schema registry (``streams.wire``), so
schema evolution follows the registry exactly as in the embedded engine.

The windowing is the shared per-entity state machine (``streams.features.compute.EntityWindows``)
in a ``KeyedProcessFunction`` keyed by the Kafka key, its state in Flink keyed state (so
checkpoints carry it). Late readings go to the DLQ topic with their original bytes and the
reason, as in the embedded engine. With ``--redis`` the newest row of each entity also goes to the
online store, Feast's Redis layout under ``--project``, as in the other engines.

    python -m streams.flink.job --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081 \\
        --jar <home>/flink/lib/flink-sql-connector-kafka-*.jar [--bounded] [--redis redis://127.0.0.1:6379/0 --project pm]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from pyflink.common import Configuration, Row, Types
from pyflink.datastream import StreamExecutionEnvironment
from pyflink.table import StreamTableEnvironment

from streams.features.spec import load_feature_set
from streams.security.kafka import KafkaSecurity
from streams.flink.functions import LATE, RECORD, WindowFunction

log = logging.getLogger("tangram.flink")


def _kafka_table(name: str, topic: str, bootstrap: str, *, source: bool, group: str = "", bounded: bool = False,
                 security: KafkaSecurity) -> str:
    opts = {
        "connector": "kafka",
        "topic": topic,
        "properties.bootstrap.servers": bootstrap,
        **{f"properties.{k}": v for k, v in security.java(shaded=True).items()},
        "key.format": "raw",
        "key.fields": "k",
        "value.format": "raw",
        "value.fields-include": "EXCEPT_KEY",
    }
    if source:
        opts.update({"properties.group.id": group, "scan.startup.mode": "group-offsets",
                     "properties.auto.offset.reset": "earliest", "properties.isolation.level": "read_committed"})
        if bounded:
            opts["scan.bounded.mode"] = "latest-offset"
    else:
        opts.update({"sink.delivery-guarantee": "at-least-once", "properties.enable.idempotence": "true",
                     "properties.acks": "all"})
    with_ = ", ".join(f"'{k}' = '{str(v).replace(chr(39), chr(39) * 2)}'" for k, v in opts.items())
    return (f"CREATE TEMPORARY TABLE `{name}` (k STRING, v BYTES, headers MAP<STRING, BYTES> METADATA) "
            f"WITH ({with_})")


def build_job(t_env: StreamTableEnvironment, env: StreamExecutionEnvironment, args: argparse.Namespace) -> None:
    """Source table → keyed windows → output and DLQ tables."""
    fs = load_feature_set(args.feature_set)
    source_topic = args.source or fs.source.topic
    output_topic = args.output or fs.output.topic
    security = KafkaSecurity.from_environ(os.environ)  # TANGRAM_KAFKA_SECURITY, as every client reads it
    t_env.execute_sql(_kafka_table("source", source_topic, args.bootstrap, source=True, group=args.group,
                                   bounded=args.bounded, security=security))
    t_env.execute_sql(_kafka_table("features", output_topic, args.bootstrap, source=False, security=security))
    t_env.execute_sql(_kafka_table("dlq", args.dlq, args.bootstrap, source=False, security=security))
    records = t_env.to_data_stream(t_env.from_path("source")).map(
        lambda r: Row(k=r[0], v=r[1], headers=r[2]), output_type=RECORD)
    function = WindowFunction(str(args.feature_set), args.registry, fs.source.schema_,
                              fs.output.schema_, source_topic, redis_url=args.redis, project=args.project)
    rows = records.key_by(lambda r: r.k, key_type=Types.STRING()).process(function, output_type=RECORD)
    statements = t_env.create_statement_set()
    statements.add_insert("features", t_env.from_data_stream(rows))
    statements.add_insert("dlq", t_env.from_data_stream(rows.get_side_output(LATE)))
    statements.execute().wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="streams.flink.job", description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers.")
    p.add_argument("--registry", required=True, help="Schema registry URL.")
    p.add_argument("--jar", action="append", default=[], help="Connector jar(s) to add to the classpath.")
    p.add_argument("--feature-set", required=True, help="Feature-set declaration (YAML).")
    p.add_argument("--source", help="Input topic (default: the feature set's).")
    p.add_argument("--output", help="Output topic (default: the feature set's).")
    p.add_argument("--dlq", required=True, help="Dead-letter topic for late and undecodable readings.")
    p.add_argument("--group", default="pm.features-flink", help="Consumer group of the source.")
    p.add_argument("--redis", help="Online store (Feast's Redis layout), e.g. redis://127.0.0.1:6379/0; none: not written.")
    p.add_argument("--project", help="Feast project of the online store (the topology's app); needed with --redis.")
    p.add_argument("--bounded", action="store_true", help="Stop at the offsets that are latest at start (tests, backfills).")
    p.add_argument("--parallelism", type=int, default=1)
    p.add_argument("--checkpoint-ms", type=int, default=10_000, help="Checkpoint interval (0: none).")
    args = p.parse_args(argv)
    if args.redis and not args.project:
        p.error("--redis needs --project: the Feast project the online store's rows belong to (the topology's app)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = Configuration()
    config.set_string("python.executable", sys.executable)
    config.set_string("python.client.executable", sys.executable)
    config.set_string("python.fn-execution.bundle.size", "1000")
    config.set_string("python.fn-execution.bundle.time", "100")
    config.set_string("pipeline.name", f"tangram-features-{Path(args.feature_set).stem}")
    if args.jar:
        config.set_string("pipeline.jars", ";".join(Path(j).resolve().as_uri() for j in args.jar))
    env = StreamExecutionEnvironment.get_execution_environment(config)
    env.set_parallelism(args.parallelism)
    if args.checkpoint_ms and not args.bounded:
        env.enable_checkpointing(args.checkpoint_ms)
    t_env = StreamTableEnvironment.create(env)
    started = time.monotonic()
    build_job(t_env, env, args)
    log.info("flink feature job finished in %.1fs", time.monotonic() - started)


if __name__ == "__main__":
    main()
