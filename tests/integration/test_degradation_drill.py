"""Degradation on real Kafka: the manual switch within a second, and a drill that stops Triton.

The drill runs its own Triton (ports 28020-28022 shifted by ``TANGRAM_TEST_PORT_OFFSET``,
``inference_workers/triton_server.py`` from .venv-triton) so that the session's Triton, which
other tests use, is never stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from reference import REPO as PROJECT_ROOT
from streams.stack.components import TRITON_SERVER
from streams.config_center import ConfigCenter
from streams.launcher import Processors

from rules_helpers import Actions, Feed, InProcess, rules_topology, window

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000
#: Below the kernel's ephemeral range (32768+), where a client socket can hold a port; shifted like the stack's.
_OFFSET = int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0"))
DRILL_PORTS = {"triton_http_port": 28020 + _OFFSET, "triton_grpc_port": 28021 + _OFFSET,
               "triton_metrics_port": 28022 + _OFFSET}
RULES = [
    {"name": "scored", "when": "score >= 0", "action": "review", "levels": ["L0", "L1"]},
    {"name": "vibration_features", "when": "vibration_std > 1.2", "action": "maintenance", "levels": ["L2"]},
]
DEGRADATION = {"window_s": 6, "prediction_wait_ms": 2000, "min_samples": 3,
               "triggers": [{"signal": "missing_predictions", "above": 0.5, "below": 0.1, "hold_s": 3, "level": "L2"}],
               "safe_default": {"action": "review"}}


def wait_for(predicate, timeout_s: float, what: str, step_s: float = 0.01) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(step_s)
    return time.monotonic() - started


def test_the_manual_switch_reaches_every_processor_within_a_second(stack, tmp_path):
    topology, _, prefix = rules_topology(tmp_path, stack, rules=RULES, cooldown_ms=0, degradation=DEGRADATION)
    center = ConfigCenter(stack.kafka, f"_tangram.config.{prefix}")
    feed, actions = Feed(stack, prefix), Actions(stack, prefix)
    with InProcess(topology, "rules", stack, group=f"{prefix}.a") as a, \
            InProcess(topology, "rules", stack, group=f"{prefix}.b") as b:
        wait_for(lambda: a.processor.config is not None and b.processor.config is not None, 30, "processors started")
        times = {}
        for level in ("L2", "L3", "L0"):
            center.set("feature-switch", "degradation.level", level, "test", f"drill {level}")
            times[level] = wait_for(lambda: a.processor.level == level and b.processor.level == level, 5,
                                    f"both processors at {level}")
            if level != "L0":
                end = T0 + 5000 * len(times)
                feed.windows([window("d-1", end, vibration_std=2.0)])
                found = actions.until(lambda seen: any(x["window_end"] == end for x in seen), 20)
                mine = [x for x in found if x["window_end"] == end]
                assert {x["degradation_level"] for x in mine} == {level}
                assert {x["rule"] for x in mine} == ({"vibration_features"} if level == "L2" else {"safe_default"})
                assert all(x["model_versions"] == {} and x["model_name"] == "" for x in mine)
    print(f"\nmanual switch → both processors: {', '.join(f'{k} {v * 1000:.0f} ms' for k, v in times.items())}")
    assert all(t < 1.0 for t in times.values()), times
    actions.close()


def _triton_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class OwnTriton:
    """A Triton of this test only, on the drill ports, serving the stack's model repository."""

    def __init__(self, stack, log: Path):
        self.stack, self.log, self.process = stack, log, None

    def start(self, timeout_s: float = 90.0) -> float:
        python = self.stack.triton_python
        assert python.exists(), f"{python} is missing: create the model-server environment (make .venv-triton/.installed)"
        assert not _triton_ready(DRILL_PORTS["triton_http_port"]), "something already answers on the drill ports"
        started = time.monotonic()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(python), str(TRITON_SERVER), "--model-repository",
                 str(self.stack.model_repository), "--host", "127.0.0.1",
                 "--http-port", str(DRILL_PORTS["triton_http_port"]), "--grpc-port", str(DRILL_PORTS["triton_grpc_port"]),
                 "--metrics-port", str(DRILL_PORTS["triton_metrics_port"])],
                cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while not _triton_ready(DRILL_PORTS["triton_http_port"]):
            if self.process.poll() is not None or time.monotonic() - started > timeout_s:
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
                raise AssertionError(f"drill Triton did not become ready:\n{tail}")
            time.sleep(0.2)
        return time.monotonic() - started

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self.process = None


def test_drill_triton_stops_l2_actions_flow_then_l0_returns(stack, tmp_path):
    drill_stack = stack.model_copy(update=DRILL_PORTS)
    topology, path, prefix = rules_topology(tmp_path, stack, rules=RULES, cooldown_ms=0, degradation=DEGRADATION)
    feed, actions = Feed(stack, prefix), Actions(stack, prefix)
    triton = OwnTriton(stack, tmp_path / "drill-triton.log")
    stop = threading.Event()

    def windows() -> None:  # 4 devices, one window each every 0.5 s; d-0 vibrates
        k = 0
        while not stop.is_set():
            feed.windows([window(f"d-{d}", T0 + 5000 * k, vibration_std=2.0 if d == 0 else 0.4) for d in range(4)])
            k += 1
            time.sleep(0.5)

    feeder = threading.Thread(target=windows, daemon=True)
    try:
        triton.start()
        with Processors(path, drill_stack, names=["inference"]) as inference, \
                InProcess(topology, "rules", stack) as rules:
            inference.start()
            inference.wait_joined(90, names=["inference"])
            feeder.start()
            actions.until(lambda seen: any(a["degradation_level"] == "L0" for a in seen), 60)
            assert rules.processor.level == "L0"
            stopped = time.monotonic()
            triton.stop()
            actions.until(lambda seen: any(a["degradation_level"] == "L2" for a in seen), 30)
            to_l2 = next(a["_received"] for a in actions.seen if a["degradation_level"] == "L2") - stopped
            l2 = [a for a in actions.seen if a["degradation_level"] == "L2"]
            assert {a["rule"] for a in l2} == {"vibration_features"} and {a["device_id"] for a in l2} == {"d-0"}
            restarted = time.monotonic()
            triton.start()
            back = wait_for(lambda: rules.processor.level == "L0", 90, "back to L0", 0.1)  # from Triton ready
            n = len(actions.seen)
            actions.until(lambda seen: any(a["degradation_level"] == "L0" for a in seen[n:]), 30)
            back_s = time.monotonic() - restarted
        print(f"\ndrill: Triton stopped → first L2 action after {to_l2:.1f} s; Triton ready again → L0 after "
              f"{back:.1f} s; restart → L0 actions again after {back_s:.1f} s")
        assert to_l2 < 15.0
        per_window = {}
        for a in actions.seen:
            per_window.setdefault((a["device_id"], a["window_end"]), set()).add(a["degradation_level"])
        assert all(len(levels) == 1 for levels in per_window.values())  # one window, one path
    finally:
        stop.set()
        if feeder.is_alive():
            feeder.join(10)
        triton.stop()
        actions.close()
