import numpy as np
import pytest

from pm_app import FEATURE_NAMES, FEATURE_SET, feature_vector, window_features
from streams.features import EntityWindows, band_energy
from streams.features.spec import FeatureSet
from pm_app.simulator import SENSORS, Device, Fleet, windows_for_training


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
    assert band_energy(np.sin(2 * np.pi * 1.0 * t), 10.0, 2.5) < 0.05
    assert band_energy(np.sin(2 * np.pi * 4.0 * t), 10.0, 2.5) > 0.95
    assert band_energy(np.full(50, 3.0), 10.0, 2.5) == 0.0
    assert band_energy(np.array([np.nan] * 50), 10.0, 2.5) == 0.0


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


# -- the shared event-time state machine (every engine runs it) ------------------------------


def _reference(readings: list[tuple[int, list[float]]], fs: FeatureSet) -> tuple[dict[int, dict], int]:
    """Plain numpy: which readings are late, and the features of every window that closed."""
    w = fs.window
    windows: dict[int, list[tuple[int, list[float]]]] = {}
    wm, late, closed = -1, 0, set()
    for ts, row in readings:
        starts = [s for s in w.starts(ts) if not (s + w.size_ms + w.allowed_lateness_ms <= wm)]
        if not starts:
            late += 1
            continue
        for s in starts:
            windows.setdefault(s, []).append((ts, row))
        wm = max(wm, ts)
        closed |= {s for s in windows if s + w.size_ms + w.allowed_lateness_ms <= wm}
    out = {}
    for s in sorted(closed):
        rows = sorted(windows[s], key=lambda r: r[0])
        out[s] = {"count": len(rows), **window_features(np.array([r for _, r in rows]), fs.sample_hz)}
    return out, late


@pytest.mark.parametrize("hop_ms", [5000, 1000])
def test_out_of_order_and_late_readings_match_the_reference(hop_ms):
    fs = FEATURE_SET.model_copy(update={"window": FEATURE_SET.window.model_copy(update={"hop_ms": hop_ms})})
    rng = np.random.default_rng(4)
    ts = list(range(0, 40_000, 100))
    for i in range(5, len(ts) - 1, 7):
        ts[i], ts[i + 1] = ts[i + 1], ts[i]  # out of order
    for i in range(50, len(ts), 60):
        ts.insert(i, ts[i] - 1500)  # inside the allowed lateness for most windows
    for i in range(90, len(ts), 120):
        ts.insert(i, ts[i] - 9000)  # late
    readings = [(t, list(rng.normal(10, 2, len(SENSORS)))) for t in ts]
    for _, row in readings[::17]:
        row[2] = np.nan
    state, got, late = EntityWindows(fs), {}, 0
    for t, row in readings:
        accepted, closed = state.add(t, row)
        late += not accepted
        for c in closed:
            got[c["window_start"]] = {k: v for k, v in c.items() if k not in ("start", "window", "window_start", "window_end")}
    expected, expected_late = _reference(readings, fs)
    assert late == expected_late > 0
    assert got.keys() == expected.keys()
    for start in expected:
        assert got[start]["count"] == expected[start]["count"]
        for name in FEATURE_NAMES:
            assert got[start][name] == pytest.approx(expected[start][name], rel=1e-12, abs=1e-15), (start, name)


def test_a_window_already_emitted_before_a_restart_is_not_emitted_again():
    state = EntityWindows(FEATURE_SET, emitted_end=10_000)
    assert state.add(9_900, [1.0] * len(SENSORS)) == (False, [])
    accepted, closed = state.add(10_100, [1.0] * len(SENSORS))
    assert accepted and closed == []
