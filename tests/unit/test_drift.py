"""Drift statistics, the sustained-drift detector and the simulator's drift injection, offline (no Kafka)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pm_app import FEATURE_NAMES, FEATURE_SET
from pm_app.drift import (
    DECLARED_ALERT_RATE, declared_delay_rows, detect, false_alarms, feature_rows, references, stamp,
)
from pm_app.simulator import Device, Drift, windows_for_training
from pm_app.train import DatasetParams
from reference import PM
from streams.errors import DriftBaselineError
from streams.features.spec import load_feature_set
from streams.monitor.baseline import load_baseline
from streams.monitor.processor import DriftMonitor, DriftSettings
from streams.monitor.stats import DriftDetector, NumericReference, Thresholds, categorical, psi
from streams.topology import load_topology

CARD = PM / "model_repository" / "anomaly" / "model_card.json"  # built by `make setup`
WINDOW, STEP, CONSECUTIVE = 300, 100, 3  # the reference topology's drift params


@pytest.fixture(scope="module")
def refs():
    return references(load_baseline(CARD).features)


# -- the simulator ------------------------------------------------------------------------------
def test_a_device_without_drift_samples_exactly_as_before():
    t = np.arange(100) / 10.0
    plain = Device.random("d", np.random.default_rng(3)).sample(t, np.random.default_rng(4))
    again = Device.random("d", np.random.default_rng(3)).sample(t, np.random.default_rng(4))
    np.testing.assert_array_equal(plain, again)


@pytest.mark.parametrize("drift, check", [
    (Drift("temperature", "shift", 5.0, start_s=5.0), lambda before, after: after.mean() - before.mean() > 4.5),
    (Drift("vibration", "scale", 3.0, start_s=5.0), lambda before, after: after.std() > 2.5 * before.std()),
    (Drift("pressure", "category", 20.0, start_s=5.0, share=0.3),
     lambda before, after: 0.2 < np.mean(after == 20.0) < 0.4 and not np.any(before == 20.0)),
])
def test_drift_changes_its_sensor_from_its_start_only(drift, check):
    from dataclasses import replace

    from pm_app.simulator import SENSORS

    t = np.arange(2000) / 100.0
    device = replace(Device.random("d", np.random.default_rng(1)), drifts=(drift,))
    values = device.sample(t, np.random.default_rng(2))
    column = values[:, SENSORS.index(drift.sensor)]
    assert check(column[t < 5.0], column[t >= 5.0])
    others = [j for j, s in enumerate(SENSORS) if s != drift.sensor]
    plain = Device.random("d", np.random.default_rng(1)).sample(t, np.random.default_rng(2))
    if drift.kind != "category":  # category draws extra random numbers, the others do not
        np.testing.assert_array_equal(values[:, others], plain[:, others])


def test_drift_refuses_unknown_sensors_and_kinds():
    with pytest.raises(ValueError, match="unknown sensor"):
        Drift("humidity", "shift", 1.0)
    with pytest.raises(ValueError, match="unknown drift kind"):
        Drift("temperature", "rotate", 1.0)


def test_training_windows_are_unchanged_without_drift():
    a = windows_for_training(5, 20.0, 5.0, 10.0, 42)
    b = windows_for_training(5, 20.0, 5.0, 10.0, 42, drifts=())
    np.testing.assert_array_equal(a.windows, b.windows)
    assert a.labels == b.labels and a.registers == b.registers


# -- statistics ------------------------------------------------------------------------------------
def test_psi_is_near_zero_for_the_same_distribution_and_large_for_a_shift():
    rng = np.random.default_rng(0)
    ref = rng.normal(0, 1, 10_000)
    assert psi(ref, rng.normal(0, 1, 5_000)) < 0.01
    assert psi(ref, rng.normal(1, 1, 5_000)) > 0.5


def test_numeric_reference_flags_shape_changes_with_ks_and_psi():
    rng = np.random.default_rng(1)
    ref = NumericReference.of(rng.normal(0, 1, 10_000))
    same, wide = ref.test(rng.normal(0, 1, 300)), ref.test(rng.normal(0, 2, 300))
    assert same.pvalue > 0.01 and same.psi < 0.1
    assert wide.pvalue < 1e-6 and wide.psi > 0.2


def test_a_new_category_is_caught_by_chi_square_and_psi():
    reference = {"healthy": 0.8, "bearing_wear": 0.1, "overheating": 0.1}
    same = categorical(reference, ["healthy"] * 80 + ["bearing_wear"] * 10 + ["overheating"] * 10)
    new = categorical(reference, ["healthy"] * 60 + ["bearing_wear"] * 10 + ["overheating"] * 10 + ["sensor_x"] * 20)
    assert same.pvalue > 0.5 and same.psi < 0.01
    assert new.pvalue < 1e-6 and new.psi > 0.5


def test_a_drift_becomes_an_alert_once_after_the_declared_consecutive_evaluations():
    rng = np.random.default_rng(2)
    detector = DriftDetector({"x": NumericReference.of(rng.normal(0, 1, 5_000))}, window=100, step=50)
    thresholds = Thresholds(consecutive=3)
    evaluations = detector.add([{"x": v, "ts_ms": i} for i, v in enumerate(rng.normal(3, 1, 400))], thresholds)
    streaks = [e.verdicts[0].consecutive for e in evaluations]
    assert streaks == [1, 2, 3, 4, 5, 6, 7]
    assert [bool(e.alerts) for e in evaluations] == [False, False, True, False, False, False, False]
    assert evaluations[-1].start_ms == 300 and evaluations[-1].end_ms == 399


# -- the baseline ------------------------------------------------------------------------------------
def test_the_baseline_is_the_training_sample_the_model_card_names():
    baseline = load_baseline(CARD)
    card = json.loads(CARD.read_text())
    assert baseline.dataset_version == card["dataset_version"] == DatasetParams().version
    for name in FEATURE_NAMES:
        assert baseline.features[name].mean() == pytest.approx(card["baseline"][name]["mean"], rel=1e-9, abs=1e-12)
        assert np.quantile(baseline.features[name], 0.5) == pytest.approx(card["baseline"][name]["quantiles"][5])
    assert set(baseline.label_shares) == set(card["classes"]) and sum(baseline.label_shares.values()) == pytest.approx(1)
    assert baseline.label_shares["healthy"] > 0.6 and len(baseline.confidence) == card["train_windows"]


def test_a_baseline_sample_changed_after_training_is_refused(tmp_path):
    model = shutil.copytree(CARD.parent, tmp_path / "anomaly")
    sample = model / json.loads(CARD.read_text())["baseline_sample"]["file"]
    data = bytearray(sample.read_bytes())
    data[len(data) // 2] ^= 0xFF
    sample.write_bytes(bytes(data))
    with pytest.raises(DriftBaselineError, match="sha256"):
        load_baseline(model / "model_card.json")


def test_a_model_card_without_a_baseline_sample_says_what_the_training_script_must_do(tmp_path):
    model = shutil.copytree(CARD.parent, tmp_path / "anomaly")
    card = json.loads(CARD.read_text())
    del card["baseline_sample"]
    (model / "model_card.json").write_text(json.dumps(card))
    with pytest.raises(DriftBaselineError, match="write_baseline"):
        load_baseline(model / "model_card.json")


# -- measured promises ---------------------------------------------------------------------------------
def test_a_stationary_stream_stays_below_the_declared_false_alarm_rate(refs):
    evaluations = alerts = 0
    for seed in (1001, 1002):
        fa = false_alarms(refs, stamp(feature_rows(DatasetParams(), seed), 300, 5.0), Thresholds(), WINDOW, STEP)
        evaluations += fa.evaluations
        alerts += fa.alerts
    assert evaluations >= 200
    assert alerts / evaluations <= DECLARED_ALERT_RATE, (alerts, evaluations)


@pytest.mark.parametrize("drift", [
    Drift("temperature", "shift", 2.0),
    Drift("vibration", "scale", 1.5),
    Drift("pressure", "category", 9.0, share=0.2),
])
def test_an_injected_drift_is_alerted_within_the_declared_delay(refs, drift):
    before = feature_rows(DatasetParams(), 2001)[:1000]
    after = feature_rows(DatasetParams(), 2002, [drift])
    detection = detect(refs, before, after, drift, Thresholds(), WINDOW, STEP)
    assert detection.delay_rows is not None and detection.delay_rows <= declared_delay_rows(STEP, CONSECUTIVE)
    assert detection.feature is not None and detection.feature.startswith(drift.sensor)


# -- live thresholds -------------------------------------------------------------------------------------
class _Config:
    version = 7

    def __init__(self, values: dict):
        self.values = values

    def get(self, namespace: str, key: str, default=None, entity=None):
        return self.values.get((namespace, key), default)


def test_config_center_thresholds_override_the_topology_defaults():
    monitor = DriftMonitor(codecs={}, monitors={}, drift_topic="pm.monitor.drift", alert_topic="pm.actions.alert",
                           dlq_topic="pm.dlq.monitor", card_path=CARD,
                           settings=DriftSettings(model="anomaly", drift_topic="pm.monitor.drift",
                                                  alert_topic="pm.actions.alert", entity_field="device_id"))
    assert monitor.thresholds() == Thresholds()
    monitor.config = _Config({("monitor-threshold", "drift.psi"): 0.3, ("monitor-threshold", "drift.consecutive"): 2})
    assert monitor.thresholds() == Thresholds(psi=0.3, consecutive=2)
    monitor.config = _Config({("monitor-threshold", "drift.ks_pvalue"): 5.0})  # out of range: defaults kept
    assert monitor.thresholds() == Thresholds()


# -- what is compared -------------------------------------------------------------------------------------
def test_the_reference_drift_job_compares_the_window_aggregates_not_the_register_attributes():
    topology = load_topology(PM / "topology.yaml")
    settings = DriftSettings.model_validate(topology.processors["drift"].params)
    assert settings.compare == "aggregates"
    compared = load_feature_set(topology.path(settings.feature_set)).aggregate_names
    monitor = DriftMonitor(codecs={}, monitors={"pm.features.device_window": "features"}, drift_topic="pm.monitor.drift",
                           alert_topic="pm.actions.alert", dlq_topic="pm.dlq.monitor", card_path=CARD,
                           settings=settings.model_copy(update={"config_center": False}), compared=compared)
    monitor.setup()
    tested = monitor.detectors["features"].features
    assert tested == list(FEATURE_SET.aggregate_names) == list(references(load_baseline(CARD).features))
    assert FEATURE_SET.attribute_names and not set(tested) & set(FEATURE_SET.attribute_names)
    # the baseline still holds every input: the prediction reference is the model scoring whole vectors
    assert list(load_baseline(CARD).features) == list(FEATURE_NAMES)


def test_compare_aggregates_needs_the_feature_set_and_a_baseline_that_holds_them(tmp_path):
    with pytest.raises(ValueError, match="needs `feature_set:`"):
        DriftSettings(model="anomaly", drift_topic="d", alert_topic="a", entity_field="device_id", compare="aggregates")
    settings = DriftSettings(model="anomaly", drift_topic="d", alert_topic="a", entity_field="device_id",
                             config_center=False)
    monitor = DriftMonitor(codecs={}, monitors={"t": "features"}, drift_topic="d", alert_topic="a", dlq_topic="q",
                           card_path=CARD, settings=settings, compared=("temperature_mean", "humidity_mean"))
    with pytest.raises(DriftBaselineError, match=r"no sample of \['humidity_mean'\]"):
        monitor.setup()
