"""Golden signals measured from the data; triggers with hysteresis; the manual switch."""

import numpy as np
import pytest

from streams.rules.degradation import GoldenSignals, LevelController
from streams.rules.spec import DegradationSpec, Trigger


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


SPEC = DegradationSpec(window_s=10, prediction_wait_ms=3000, min_samples=3, triggers=[
    Trigger(signal="missing_predictions", above=0.5, below=0.1, hold_s=5, level="L2"),
    Trigger(signal="inference_p99_ms", above=1000, below=200, hold_s=5, level="L1"),
])


def test_missing_predictions_is_the_share_of_windows_without_a_prediction_after_the_wait():
    clock = Clock()
    signals = GoldenSignals(SPEC, clock)
    for i in range(4):
        signals.window("d", i)
    signals.prediction("d", 0, 5.0)
    signals.prediction("d", 1, 5.0)
    assert signals.values()["missing_predictions"] == 0.0 or signals.values()["missing_predictions"] is None
    clock.t += 3.0
    assert signals.values()["missing_predictions"] == pytest.approx(0.5)
    # a prediction read before its window counts too (two topics, any order)
    signals.prediction("d", 9, 5.0)
    signals.window("d", 9)
    assert signals.values()["missing_predictions"] == pytest.approx(2 / 5)


def test_prediction_age_only_while_windows_flow():
    clock = Clock()
    signals = GoldenSignals(SPEC, clock)
    assert signals.values()["prediction_age_s"] is None
    signals.prediction("d", 0, 1.0)
    clock.t += 4
    signals.window("d", 5)
    assert signals.values()["prediction_age_s"] == pytest.approx(4)


def test_inference_p99_is_numpys_percentile_over_the_window_and_the_newest_samples():
    """The p99 kept as runs of a batch's shared latency is numpy's over every sample: of the window only, and
    of its newest ``LATENCY_SAMPLES`` when more arrived (batches of one latency, of several, and single rows)."""
    clock, rng = Clock(), np.random.default_rng(7)
    signals = GoldenSignals(SPEC, clock)
    arrived: list[tuple[float, list[float]]] = []
    checked = 0
    for step in range(2500):
        clock.t += 0.01
        latencies = np.repeat(rng.gamma(2.0, 5.0, size=int(rng.integers(1, 4))).round(1),
                              int(rng.integers(1, 30))).tolist()
        signals.predictions(["d"] * len(latencies), [step] * len(latencies), latencies)
        arrived.append((clock.t, latencies))
        if step % 50 == 0:
            window = [v for at, batch in arrived if at >= clock.t - SPEC.window_s for v in batch]
            expected = float(np.percentile(window[-GoldenSignals.LATENCY_SAMPLES:], 99))
            assert signals.values()["inference_p99_ms"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
            checked += 1
    assert checked == 50 and len(window) > GoldenSignals.LATENCY_SAMPLES  # the cap was exercised
    clock.t += SPEC.window_s + 1
    assert signals.values()["inference_p99_ms"] is None  # the window emptied


def test_triggers_enter_above_and_leave_below_after_the_hold():
    clock = Clock()
    levels = LevelController(SPEC, "test", clock=clock)
    assert levels.update({"missing_predictions": 0.4}) == "L0"
    assert levels.update({"missing_predictions": 0.6}) == "L2"
    assert levels.update({"missing_predictions": 0.3}) == "L2"  # between the thresholds: stays
    assert levels.update({"missing_predictions": 0.05}) == "L2"  # below, but not for long enough
    clock.t += 3
    assert levels.update({"missing_predictions": 0.2}) == "L2"  # interrupted: the hold restarts
    assert levels.update({"missing_predictions": 0.0}) == "L2"
    clock.t += 4.9
    assert levels.update({"missing_predictions": 0.0}) == "L2"
    clock.t += 0.2
    assert levels.update({"missing_predictions": 0.0}) == "L0"


def test_no_data_keeps_the_state():
    levels = LevelController(SPEC, "test", clock=Clock())
    assert levels.update({"missing_predictions": 0.9}) == "L2"
    assert levels.update({"missing_predictions": None}) == "L2"


def test_the_highest_of_manual_and_triggered_is_in_effect():
    clock = Clock()
    levels = LevelController(SPEC, "test", clock=clock)
    assert levels.update({"inference_p99_ms": 1500.0}) == "L1"
    assert levels.set_manual("L3") == "L3"
    assert levels.set_manual("L0") == "L1"
    assert levels.update({"missing_predictions": 1.0, "inference_p99_ms": 1500.0}) == "L2"


def test_hysteresis_must_be_declared_the_right_way_round():
    with pytest.raises(ValueError, match="hysteresis"):
        Trigger(signal="missing_predictions", above=0.1, below=0.5, level="L2")
