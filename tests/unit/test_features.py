import numpy as np
import pytest

from streams.features import FEATURE_NAMES, band_energy, feature_vector, window_features
from streams.simulator import SENSORS, Device, Fleet, windows_for_training


def test_window_features_match_a_plain_numpy_reference():
    rng = np.random.default_rng(0)
    values = rng.normal(10, 2, size=(50, len(SENSORS)))
    values[3, 1] = np.nan
    values[7, 4] = np.nan
    got = window_features(values, hz=10.0)
    assert list(got) == list(FEATURE_NAMES)
    assert got["missing_rate"] == pytest.approx(2 / values.size)
    for j, s in enumerate(SENSORS):
        col = values[:, j][~np.isnan(values[:, j])]
        assert got[f"{s}_mean"] == pytest.approx(col.mean(), rel=1e-12)
        assert got[f"{s}_std"] == pytest.approx(col.std(), rel=1e-12)
        assert got[f"{s}_min"] == col.min() and got[f"{s}_max"] == col.max()
        assert got[f"{s}_ptp"] == pytest.approx(np.ptp(col))


def test_band_energy_separates_low_and_high_frequencies():
    t = np.arange(50) / 10.0
    assert band_energy(np.sin(2 * np.pi * 1.0 * t), 10.0) < 0.05
    assert band_energy(np.sin(2 * np.pi * 4.0 * t), 10.0) > 0.95
    assert band_energy(np.full(50, 3.0), 10.0) == 0.0
    assert band_energy(np.array([np.nan] * 50), 10.0) == 0.0


def test_all_missing_sensor_gives_zeros_and_full_missing_rate():
    got = window_features(np.full((10, len(SENSORS)), np.nan), hz=10.0)
    assert got["missing_rate"] == 1.0
    assert all(np.isfinite(feature_vector(got)))


def test_faults_move_the_features_they_should():
    rng = np.random.default_rng(1)
    t = np.arange(50) / 10.0 + 100
    healthy = window_features(Device.random("h", rng).sample(t, rng), 10)
    bearing = window_features(Device.random("b", rng, "bearing_wear", 0.0).sample(t, rng), 10)
    hot = window_features(Device.random("o", rng, "overheating", 0.0).sample(t, rng), 10)
    assert bearing["vibration_band_energy"] > 0.4 > healthy["vibration_band_energy"]
    assert hot["temperature_mean"] > healthy["temperature_mean"] + 15


def test_fleet_ticks_are_json_with_every_fault_present():
    fleet = Fleet.demo(n_devices=10, seed=3)
    assert {d.fault for d in fleet.devices} >= {"bearing_wear", "overheating", "sensor_dropout", "clock_skew", "malformed", "none"}
    batch = fleet.tick(0, 1_800_000_000_000)
    assert len(batch) == 10 and all(isinstance(v, bytes) for _, v in batch)
    labels = fleet.labels(1_800_000_000_000)
    assert {label["fault"] for label in labels} == {d.fault for d in fleet.devices}


def test_training_windows_are_labelled_from_the_ground_truth():
    windows, labels, faults = windows_for_training(10, 60, 5, 10, seed=2)
    assert windows.shape[1:] == (50, len(SENSORS))
    assert set(labels) <= {"healthy", "bearing_wear", "overheating"}
    for label, fault in zip(labels, faults):
        assert label == "healthy" or label == fault
