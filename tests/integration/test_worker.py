"""Inference workers on the real Kafka and a real Triton: kill -9, Triton down, Triton hanging, routing.

These tests run their own Triton (``inference_workers/triton_server.py`` on ports
28010-28012, shifted by TANGRAM_TEST_PORT_OFFSET: below the kernel's ephemeral range, where a client
connection's local port could take one of them) so that they can stop, freeze and restart it without disturbing the session stack's.
Its repository holds two versions of ``anomaly``: the project's trained model (version 1) and one
trained with another seed (version 2, other weights), with the checked-in config.pbtxt, so Triton
loads version 2 at start (its version policy: the latest one) and a worker routed to version 1 has it
loaded through Triton's explicit model control. Kafka and the schema registry are the session stack's.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition

from inference_workers.routing import key_bucket
from pm_app.train import train
from inference_workers.triton_client import ModelRepository
from reference import REPO as PROJECT_ROOT
from streams.avro import codec
from streams.delivery import Record, Runner, RunnerConfig
from streams.errors import BackpressureError
from pm_app import FEATURE_NAMES
from streams.plan import apply
from streams.run import build_processor
from streams.settings import StackSettings
from streams.topology import Topology, load_topology
from reference import load_schema

from conftest import stack_env
from isolation import isolated_topology
from test_delivery import read_all, wait_for_count
from triton_helpers import GRPC_PORT, HOST, REPOSITORY, TritonProcess, own_triton

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    root = tmp_path_factory.mktemp("worker-triton")
    production = REPOSITORY / "anomaly" / "1" / "model.onnx"
    if not production.is_file():
        pytest.fail(f"{production} is missing: run `tangram model train` (make model)")
    repository = root / "repository"
    (repository / "anomaly" / "1").mkdir(parents=True)
    shutil.copy(REPOSITORY / "anomaly" / "config.pbtxt", repository / "anomaly" / "config.pbtxt")
    shutil.copy(REPOSITORY / "anomaly" / "labels.txt", repository / "anomaly" / "labels.txt")
    shutil.copy(production, repository / "anomaly" / "1" / "model.onnx")
    # Version 2: the same training script, another seed (different weights).
    train(root / "trained", seed=7, n_devices=120, seconds=120.0, version=2)
    (repository / "anomaly" / "2").mkdir(parents=True)
    shutil.copy(root / "trained" / "anomaly" / "2" / "model.onnx", repository / "anomaly" / "2" / "model.onnx")
    server = TritonProcess(repository, root / "triton.log")
    try:
        print(f"\nprivate Triton ready in {server.start():.1f}s")
        yield server
    finally:
        server.stop()


def served_versions() -> set[str]:
    """The versions of ``anomaly`` the private Triton serves now (READY in its repository index)."""

    async def read() -> set[str]:
        async with ModelRepository(f"{HOST}:{GRPC_PORT}", timeout_s=10.0) as repository:
            return await repository.ready_versions("anomaly")

    return asyncio.run(read())


def worker_topology(tmp_path: Path, stack: StackSettings, *, exactly_once: bool = False, batch_size: int = 64,
                    params: dict | None = None, shadow: bool = False,
                    triton_timeout_ms: int | None = None) -> tuple[Topology, Path, str]:
    """An isolated copy of the reference topology with the inference processor adjusted.

    ``triton_timeout_ms``: the deadline of one Triton call, set in the processor's ``calls:`` declaration
    (where the deadline is declared; ``tangram plan`` refuses a ``params.timeout_s`` that disagrees with it)."""
    path, prefix = isolated_topology(tmp_path)
    raw = yaml.safe_load(path.read_text())
    inference = raw["processors"]["inference"]
    inference.update(exactly_once=exactly_once, batch_size=batch_size, max_wait_ms=20)
    # the registry and config center it follows are its own (empty, created at its start): what other tests of the
    # session register or set in the shared ones must not reroute it
    inference["params"].update(registry_topic=f"_tangram.models.{prefix}", config_topic=f"_tangram.config.{prefix}")
    inference["params"].update(params or {})
    if triton_timeout_ms is not None:
        (triton,) = [call for call in inference["calls"] if call["service"] == "triton"]
        triton["timeout_ms"] = triton_timeout_ms
    if shadow:
        shadow_topic = f"{prefix}.predictions.anomaly_shadow"
        raw["topics"][shadow_topic] = {"schema": "pm.predictions.anomaly-value"}
        inference["outputs"].append(shadow_topic)
        inference["params"]["shadow_topic"] = shadow_topic
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    topology = load_topology(path)
    apply(topology, stack)
    return topology, path, prefix


def window(device: str, start: int) -> dict:
    values = {name: 1.0 for name in FEATURE_NAMES}
    values.update(missing_rate=0.0, temperature_mean=60.0, vibration_mean=2.0, current_mean=12.0,
                  pressure_mean=5.0, rpm_mean=1500.0)
    return {"device_id": device, "window_start": start, "window_end": start + 5000, "count": 50, **values}


def produce_windows(stack: StackSettings, topic: str, count: int, *, devices: int = 50, rate: float | None = None,
                    stop: threading.Event | None = None, start_ms: int = 0) -> list[tuple[str, int]]:
    """Produce ``count`` windows (``rate`` per second if given); returns their (device, window_start)."""
    encode = codec(stack.registry_url, "pm.features.device_window-value",
                   load_schema("pm.features.device_window-value")).encode
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "linger.ms": 5})
    sent = []
    began = time.monotonic()
    for i in range(count):
        if stop is not None and stop.is_set():
            break
        device, start = f"dev-{i % devices:04d}", start_ms + (i // devices) * 5000
        producer.produce(topic, encode(window(device, start)), device,
                         headers={"event_id": f"{device}:{start}", "trace_id": uuid.uuid4().hex})
        sent.append((device, start))
        if rate:
            producer.poll(0)
            time.sleep(max(0.0, began + (i + 1) / rate - time.monotonic()))
    assert producer.flush(30) == 0
    return sent


def predictions(stack: StackSettings, topic: str) -> list[tuple[str, str, int]]:
    """(version "model:version", device, window_start) of every committed prediction on ``topic``."""
    out = []
    for message in read_all(stack, topic, 3):
        model, version, device, start = dict(message.headers())["event_id"].decode().rsplit(":", 3)
        out.append((f"{model}:{version}", device, int(start)))
    return out


def wait_scored(stack: StackSettings, topic: str, sent: list[tuple[str, int]],
                timeout_s: float = 120.0) -> list[tuple[str, str, int]]:
    """Read ``topic`` (read_committed) until every window of ``sent`` is scored, then 2 s more; returns all."""
    consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(3)])
    wanted, got = set(sent), []
    seen: set[tuple[str, int]] = set()
    deadline, settle = time.monotonic() + timeout_s, None
    try:
        while time.monotonic() < deadline and (settle is None or time.monotonic() < settle):
            for message in consumer.consume(1000, 0.2):
                if message.error():
                    continue
                model, version, device, start = dict(message.headers())["event_id"].decode().rsplit(":", 3)
                got.append((f"{model}:{version}", device, int(start)))
                seen.add((device, int(start)))
            if settle is None and wanted <= seen:
                settle = time.monotonic() + 2.0  # duplicates still in flight are counted too
    finally:
        consumer.close()
    return got


def in_thread_runner(topology: Topology, stack: StackSettings, **config) -> tuple[Runner, threading.Thread]:
    """The inference processor in this process (its counters are readable), on a short poll interval."""
    spec = topology.processors["inference"]
    runner = Runner(build_processor(topology, "inference", own_triton(stack)),
                    RunnerConfig(kafka=stack.kafka, group_id=topology.group("inference"),
                                 inputs=tuple(spec.inputs), batch_size=spec.batch_size, max_wait_ms=spec.max_wait_ms,
                                 exactly_once=spec.exactly_once, **config))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    return runner, thread


def stop_runner(runner: Runner, thread: threading.Thread) -> None:
    runner.stop()
    thread.join(60)
    assert not thread.is_alive()


# ------------------------------------------------------------------------------------ tests


def test_a_contract_mismatch_is_refused_at_start_with_a_clear_message(stack, triton, tmp_path):
    """The app declares a model of two classes; Triton serves one of three: the worker refuses to start."""
    _, path, _ = worker_topology(tmp_path, stack)
    declared = tmp_path / "declared" / "anomaly"
    declared.mkdir(parents=True)
    (declared / "config.pbtxt").write_text((REPOSITORY / "anomaly" / "config.pbtxt").read_text().replace(
        "dims: [ 3 ]", "dims: [ 2 ]"))
    (declared / "labels.txt").write_text("healthy\nbearing_wear\n")
    raw = yaml.safe_load(path.read_text())
    raw["models"] = {"repository": str(declared.parent)}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, **stack_env(own_triton(stack)), "TANGRAM_TRITON_GRPC_PORT": str(GRPC_PORT)}
    result = subprocess.run([sys.executable, "-m", "streams", "run", str(path), "inference"], cwd=PROJECT_ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "output 'probabilities' dims [3] != declared [2]" in " ".join(result.stderr.split())


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
def test_kill_9_mid_batch_loses_nothing(stack, triton, tmp_path, exactly_once):
    kills_wanted = 10
    topology, path, prefix = worker_topology(tmp_path, stack, exactly_once=exactly_once, batch_size=32)
    source, out = f"{prefix}.features.device_window", f"{prefix}.predictions.anomaly"
    # windows keep arriving (300/s) until the worker has been killed ten times, however long its restarts take
    sent: list[tuple[str, int]] = []
    done = threading.Event()
    feeder = threading.Thread(target=lambda: sent.extend(produce_windows(stack, source, 60_000, rate=300.0, stop=done)))
    feeder.start()
    env = {**os.environ, **stack_env(own_triton(stack)), "TANGRAM_TRITON_GRPC_PORT": str(GRPC_PORT),
           "TANGRAM_GROUP_INSTANCE_ID": "worker-0", "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "worker.log").open("ab")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "streams", "run", str(path), "inference"], cwd=PROJECT_ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    proc, kills, seen = start(), 0, 0
    try:
        while kills < kills_wanted and feeder.is_alive():
            seen = wait_for_count(stack, out, 3, at_least=seen + 400, timeout_s=60)
            os.killpg(proc.pid, signal.SIGKILL)  # no goodbye: no flush, no commit, a transaction left open
            proc.wait()
            kills += 1
            proc = start()
        done.set()
        feeder.join()
        got = wait_scored(stack, out, sent)
    finally:
        done.set()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        feeder.join()
    identities = [(device, start) for _, device, start in got]
    missing = set(sent) - set(identities)
    duplicates = len(identities) - len(set(identities))
    mode = "exactly-once" if exactly_once else "at-least-once"
    print(f"\nkill -9 x{kills} ({mode}): {len(sent)} windows, {len(set(identities))} scored, "
          f"{len(missing)} lost, {duplicates} duplicates (read_committed)")
    assert kills == kills_wanted, "the stream ended before the tenth kill"
    assert len(sent) >= kills_wanted * 400, f"only {len(sent)} windows were sent: the check would be vacuous"
    assert not missing
    if exactly_once:
        assert duplicates == 0


def test_triton_stopped_then_restarted_loses_nothing_and_never_rebalances(stack, triton, tmp_path):
    topology, _, prefix = worker_topology(tmp_path, stack, triton_timeout_ms=1000)
    source, out = f"{prefix}.features.device_window", f"{prefix}.predictions.anomaly"
    # max.poll.interval.ms 8 s: a worker that stopped polling for the outage would leave the group.
    runner, thread = in_thread_runner(topology, stack, session_timeout_ms=6000, max_poll_interval_ms=8000,
                                      backoff_max_s=2.0)
    sent: list[tuple[str, int]] = []
    feeder = threading.Thread(target=lambda: sent.extend(produce_windows(stack, source, 3000, rate=150.0)))
    try:
        feeder.start()
        wait_for_count(stack, out, 3, at_least=100, timeout_s=60)
        assignments = runner.assignments
        triton.stop()
        stopped = time.monotonic()
        time.sleep(30.0)  # down for 30 s, far longer than max.poll.interval.ms
        restart_s = triton.start()
        print(f"\nTriton down {time.monotonic() - stopped:.1f}s (restart took {restart_s:.1f}s)")
        feeder.join()
        got = {(device, start) for _, device, start in wait_scored(stack, out, sent)}
    finally:
        stop_runner(runner, thread)
        feeder.join()
    print(f"{len(sent)} windows, {len(got)} scored, {len(set(sent) - got)} lost; paused {runner.paused_s:.1f}s "
          f"over {runner.backpressure_events} backpressure events; assignments {runner.assignments}")
    assert len(sent) == 3000 and not set(sent) - got
    assert runner.assignments == assignments == 1, "the worker was rebalanced"
    assert runner.backpressure_events >= 1 and runner.paused_s >= 25.0


def test_a_hanging_triton_hits_the_deadline_and_the_batch_is_retried(stack, triton, tmp_path):
    topology, _, prefix = worker_topology(tmp_path, stack, triton_timeout_ms=500)
    source, out = f"{prefix}.features.device_window", f"{prefix}.predictions.anomaly"
    runner, thread = in_thread_runner(topology, stack, session_timeout_ms=6000, max_poll_interval_ms=8000,
                                      backoff_max_s=1.0)
    try:
        first = produce_windows(stack, source, 200)
        wait_for_count(stack, out, 3, at_least=len(first), timeout_s=60)
        triton.freeze()
        try:
            frozen = produce_windows(stack, source, 300, start_ms=10**9)
            time.sleep(4.0)
            assert wait_for_count(stack, out, 3, at_least=0) == len(first), "scored while Triton was frozen"
            assert runner.backpressure_events >= 1  # the deadline fired
        finally:
            triton.thaw()
        got = {(device, start) for _, device, start in wait_scored(stack, out, first + frozen)}
    finally:
        stop_runner(runner, thread)
    assert not set(first + frozen) - got
    assert runner.assignments == 1


def test_canary_then_version_switches_under_load_lose_nothing_and_unload_the_old(stack, triton, tmp_path):
    """anomaly 1 with 2 as a 30 % canary → 2 with 1 in shadow → 2 alone, at 500 windows/s: Triton loads
    version 1 for the worker (it served 2 alone), and unloads it once no batch uses it."""
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"production": "1", "challenger": "2", "canary_share": 0.3}))
    topology, _, prefix = worker_topology(tmp_path, stack, params={"routing_file": str(routing)}, shadow=True)
    source, out = f"{prefix}.features.device_window", f"{prefix}.predictions.anomaly"
    shadow_topic = f"{prefix}.predictions.anomaly_shadow"
    runner, thread = in_thread_runner(topology, stack)
    sent: list[tuple[str, int]] = []
    feeder = threading.Thread(target=lambda: sent.extend(produce_windows(stack, source, 4000, devices=200, rate=500.0)))
    try:
        feeder.start()
        wait_for_count(stack, out, 3, at_least=1000, timeout_s=60)
        assert served_versions() == {"1", "2"}
        routing.write_text(json.dumps({"production": "2", "challenger": "1", "mode": "shadow"}))
        wait_for_count(stack, out, 3, at_least=2500, timeout_s=60)
        routing.write_text(json.dumps({"production": "2"}))
        switched = time.monotonic()
        feeder.join()
        got = wait_scored(stack, out, sent)
        served = served_versions()
    finally:
        stop_runner(runner, thread)
        feeder.join()
    assert len(sent) == 4000 and not set(sent) - {(device, start) for _, device, start in got}
    canary = [(v, d) for v, d, start in got if start < 5000 * 2]  # the first windows: before the switch
    assert canary and all((v == "anomaly:2") == (key_bucket(d) < 0.3) for v, d in canary)
    last = [v for v, _, start in got if start >= max(s for _, s in sent) - 5000]
    assert set(last) == {"anomaly:2"}, "after the switches production is version 2"
    shadow = predictions(stack, shadow_topic)
    assert shadow and {v for v, _, _ in shadow} == {"anomaly:1"}
    assert served == {"2"}, "version 1, no longer routed, is unloaded"
    print(f"\nversion switches under load: {len(sent)} windows, {len(got)} predictions "
          f"({sum(v == 'anomaly:1' for v, _, _ in got)} by anomaly:1, {sum(v == 'anomaly:2' for v, _, _ in got)} "
          f"by anomaly:2), {len(shadow)} shadow; last switch {time.monotonic() - switched:.1f}s before the end; "
          f"Triton serves {sorted(served)} at the end")


def test_a_replica_calling_a_version_another_replica_unloaded_backs_off_and_loses_nothing(stack, triton, tmp_path):
    """Two replicas switch at different times: A switches to 2 and unloads 1 while B still routes to 1.
    B's call is "unavailable" → backpressure (nothing produced), its error naming the version; its tries
    open B's Triton breaker, so ready() answers False without a call until the declared reset_s, then (as
    the delivery loop keeps asking) has Triton load 1 again; B's batch is then scored by 1. When B switches
    too, 1 is unloaded for good."""
    files = {name: tmp_path / f"routing-{name}.json" for name in ("a", "b")}
    for path in files.values():
        path.write_text(json.dumps({"production": "1"}))
    workers = {}
    for name, path in files.items():
        (tmp_path / name).mkdir()
        topology, _, _ = worker_topology(tmp_path / name, stack, params={"routing_file": str(path)})
        workers[name] = build_processor(topology, "inference", own_triton(stack))
    a, b = workers["a"], workers["b"]
    encode = codec(stack.registry_url, "pm.features.device_window-value",
                   load_schema("pm.features.device_window-value")).encode
    batch = [Record("t", 0, i, f"dev-{i}".encode(), encode(window(f"dev-{i}", 0)),
                    {"trace_id": b"0" * 32, "event_id": f"dev-{i}:0".encode()}, 0) for i in range(8)]

    def versions(outputs) -> set[str]:  # a prediction's id: <model>:<version>:<the window's id, dev-i:start>
        return {dict(o.headers)["event_id"].rsplit(":", 2)[0] for o in outputs}

    try:
        a.setup()
        b.setup()
        assert served_versions() >= {"1"}
        assert versions(b.process(batch)) == {"anomaly:1"}
        files["a"].write_text(json.dumps({"production": "2"}))
        assert versions(a.process(batch)) == {"anomaly:2"}  # load 2, switch, unload 1
        assert served_versions() == {"2"}
        with pytest.raises(BackpressureError, match="version 1"):
            b.process(batch)  # B has not switched: its call to 1 is refused as "unavailable"
        breaker = b.triton_guard.call_spec.circuit_breaker
        deadline = time.monotonic() + breaker.reset_s + 15.0
        while not b.ready():  # the delivery loop's wait: False while the breaker is open, then the trial
            assert time.monotonic() < deadline, f"B not ready {breaker.reset_s + 15.0:g}s after its breaker opened"
            time.sleep(0.5)
        # Triton loaded 1 again for B
        assert served_versions() == {"1", "2"}
        assert versions(b.process(batch)) == {"anomaly:1"}
        files["b"].write_text(json.dumps({"production": "2"}))
        assert versions(b.process(batch)) == {"anomaly:2"}
        assert served_versions() == {"2"}
    finally:
        a.close()
        b.close()
