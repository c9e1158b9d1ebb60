"""The rule processor measured against a raw consume→produce loop over the same records, in one run.

Needs a running stack with Kafka, the registry and Redis (`tangram up`, or TANGRAM_* variables).

    .venv/bin/python benchmarks/bench_rules.py [--records 500000] [--devices 100000]

Prints events/s through (1) a raw confluent-kafka loop that consumes the prediction records and
produces each one unchanged, committing after every acknowledged batch (the same delivery
discipline, no decoding, no rules), and (2) the rule processor in the real delivery loop (Avro
decode, online-feature reads from Redis, the reference rules, cooldowns, Avro actions), and
the ratio (2)/(1). Redis holds every device's online features first (Feast's layout, as the feature
stage writes them), so each read finds a row among ``--devices`` entities, as in production: a fleet
whose windows are mostly complete (``missing_rate`` 0.0–0.1) and one device in twenty with poor data
(0.5), so the reference rule ``poor_data`` fires for those. A tenth of the devices predict bearing wear and
a tenth overheating, with scores 0.5–0.99. The actions emitted are counted and printed with the rate.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml
from confluent_kafka import Consumer, Producer, TopicPartition

from baselines import raw_copy_seconds
from reference_app import FEATURE_SET, TOPOLOGY, load_schema
from report import Figure, emit
from streams.avro import codec
from streams.delivery import Runner, RunnerConfig
from streams.features import online_layout
from streams.features.online import OnlineWriter
from streams.namespace import namespaced
from streams.plan import apply
from streams.run import build_processor
from streams.settings import StackSettings
from streams.testing import count_records
from streams.topology import load_topology


def prediction(device: str, window_end: int, label: str, score: float) -> dict:
    """One record of the reference app's prediction contract."""
    probs = {"healthy": 1 - score, "bearing_wear": 0.0, "overheating": 0.0}
    if label != "healthy":
        probs[label] = score
    return {"event_id": f"anomaly:1:{device}:{window_end}", "device_id": device,
            "window_start": window_end - 5000, "window_end": window_end, "score": score, "label": label,
            "confidence": max(probs.values()), "probabilities": probs, "model_name": "anomaly",
            "model_version": "1", "inference_ms": 3.0, "trace_id": uuid.uuid4().hex}


def committed(probe: Consumer, topic: str, partitions: int) -> int:
    """Records of ``topic`` the probe's group has committed."""
    return sum(max(tp.offset, 0) for tp in probe.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10))


def rule_processor(stack: StackSettings, topology, total: int) -> tuple[float, int]:
    spec = topology.processors["rules"]
    group = f"bench-rules-{uuid.uuid4().hex}"
    runner = Runner(build_processor(topology, "rules", stack), RunnerConfig(
        kafka=stack.kafka, group_id=group, inputs=tuple(spec.inputs),
        batch_size=spec.batch_size, max_wait_ms=spec.max_wait_ms))
    runner.freeze_heap = True  # the stage timed as `tangram run` runs it
    thread = threading.Thread(target=runner.run, daemon=True)
    topic, n = spec.inputs[0], topology.partitions(spec.inputs[0])
    probe = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": group})
    thread.start()
    # the clock starts at the first committed batch (setup and the group join are not throughput)
    while (first := committed(probe, topic, n)) < 1:
        time.sleep(0.01)
    started = time.perf_counter()
    while committed(probe, topic, n) < total:
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    probe.close()
    total -= first  # the first batch was not timed
    runner.stop()
    thread.join(30)
    return elapsed, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--devices", type=int, default=100_000, help="entities with online features in Redis")
    args = parser.parse_args()
    stack = StackSettings()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = f"b{uuid.uuid4().hex[:8]}"
        path = namespaced(TOPOLOGY, prefix, Path(tmp) / f"{prefix}.yaml")
        raw = yaml.safe_load(path.read_text())
        rules = raw["processors"]["rules"]
        rules["inputs"] = [rules["inputs"][0]]  # predictions only: this measures deciding, not degradation
        rules["params"]["config_topic"] = f"_tangram.config.{prefix}"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        topology = load_topology(path)
        apply(topology, stack)
        source = rules["inputs"][0]
        fill_online_store(stack, topology, args.devices)
        enc = codec(stack.registry_url, "pm.predictions.anomaly-value", load_schema("pm.predictions.anomaly-value"))
        producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "acks": "all",
                             "linger.ms": 20, "compression.type": "lz4"})
        labels = ["healthy"] * 8 + ["bearing_wear", "overheating"]
        for i in range(args.records):
            row = prediction(f"dev-{i % args.devices:06d}", 1_700_000_000_000 + 5000 * (i // args.devices),
                             labels[i % len(labels)], 0.5 + (i % 50) / 100)
            while True:
                try:
                    producer.produce(source, enc.encode(row), row["device_id"])
                    break
                except BufferError:
                    producer.poll(0.1)
        assert producer.flush(60) == 0
        print(f"{args.records:,} predictions of {args.devices} devices on {source}")
        raw_s = raw_copy_seconds(stack, source, f"{prefix}.actions.review", args.records)
        spec = topology.processors["rules"]

        def actions_so_far() -> int:
            return sum(count_records(stack.kafka, t, topology.partitions(t)) for t in spec.outputs)

        copied = actions_so_far()  # the raw loop wrote its copies to an action topic
        rules_s, timed = rule_processor(stack, topology, args.records)
        actions = actions_so_far() - copied
        dead = count_records(stack.kafka, spec.dlq, topology.partitions(spec.dlq))
        assert dead == 0, f"{dead} predictions dead-lettered: the benchmark's records should all be decided"
        raw_rate, rules_rate = args.records / raw_s, timed / rules_s
        print(f"raw consume→produce loop : {raw_rate:10,.0f} events/s ({raw_s:.2f} s, {args.records:,} records out)")
        print(f"rule processor           : {rules_rate:10,.0f} events/s ({rules_s:.2f} s, {actions:,} actions out)")
        print(f"ratio rule processor/raw : {rules_rate / raw_rate:10.2f}")
        emit(Figure(f"rule processor (predictions → actions; Redis holding {args.devices:,} devices' online features)",
                    f"{rules_rate:,.0f} events/s ({actions:,} actions out)",
                    f"raw consume→produce→commit loop {raw_rate:,.0f}/s (every record out)",
                    f"{rules_rate / raw_rate:.2f} (goal ≥ 0.5)", n=args.records,
                    batch=topology.processors["rules"].batch_size, benchmark="bench_rules"))


def fill_online_store(stack: StackSettings, topology, devices: int) -> None:
    """Every device's online features, in the layout and project the rule processor reads: mostly complete
    windows, one device in twenty with half its readings missing."""
    writer = OnlineWriter(stack.redis_url, online_layout(topology, "features"))
    started = time.perf_counter()
    for i in range(devices):
        features = {name: 1.0 for name in FEATURE_SET.feature_names}
        features["missing_rate"] = 0.5 if i % 20 == 7 else (i % 11) / 100
        writer.stage({"device_id": f"dev-{i:06d}", "window_start": 0, "window_end": 5000, "count": 50, **features})
        if i % 5000 == 4999:
            writer.flush()
    writer.flush()
    writer.close()
    print(f"online store: {devices:,} devices' features written in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
