import json
import shutil

import numpy as np
import pytest

from pm_app import FEATURE_NAMES, FEATURE_SET, feature_vector, window_features
from streams.features import PartitionWindows, band_energy
from streams.features.batch import BatchWindows
from streams.features.compute import compute_windows
from streams.features.spec import FeatureSet
from pm_app.simulator import SENSORS, Device, Fleet, FleetSettings, FleetSimulator, windows_for_training
from reference import PM, pm_topology
from streams.demo import served_cards
from streams.settings import StackSettings
from streams.simulation import Observed
from streams.features.enrich import Join
from streams.features.table import VersionedTable


def test_window_features_match_a_plain_numpy_reference():
    rng = np.random.default_rng(0)
    values = rng.normal(10, 2, size=(50, len(SENSORS)))
    values[3, 1] = np.nan
    values[7, 4] = np.nan
    got = window_features(values, hz=10.0)
    assert list(got) == list(FEATURE_SET.aggregate_names)
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
    windows, labels, faults, registers = windows_for_training(10, 60, 5, 10, seed=2)
    assert windows.shape[1:] == (50, len(SENSORS))
    assert set(labels) <= {"healthy", "bearing_wear", "overheating"}
    for label, fault in zip(labels, faults):
        assert label == "healthy" or label == fault
    assert len(registers) == len(windows) and len({r["device_id"] for r in registers}) == 10
    assert all(r["status"] == "online" for r in registers)


def test_the_model_vector_is_the_aggregates_then_the_register_attributes_as_the_engines_encode_them():
    rng = np.random.default_rng(5)
    device = Device.random("d", rng)
    features = window_features(device.sample(np.arange(50) / 10.0, rng), 10.0)
    entry = device.register("plant-a")
    vector = feature_vector(features, entry)
    assert len(vector) == len(FEATURE_NAMES) == len(FEATURE_SET.aggregate_names) + len(FEATURE_SET.attribute_names)
    assert vector[:len(features)] == [features[n] for n in FEATURE_SET.aggregate_names]
    assert dict(zip(FEATURE_NAMES[len(features):], vector[len(features):])) == {
        "rated_temperature": entry["rated_temperature"], "rated_current": entry["rated_current"],
        "rated_rpm": entry["rated_rpm"]}
    # an unregistered device: the declared defaults, the fleet's typical ratings
    defaults = FEATURE_SET.enrichment.defaults
    assert feature_vector(features)[len(features):] == [defaults[n] for n in FEATURE_SET.attribute_names]
    # the embedded engine's join appends the same numbers (the runtime's one encoder)
    table = VersionedTable(FEATURE_SET.enrichment.used)
    table.put("d", 0, entry)
    join = Join(FEATURE_SET, table, "test")
    np.testing.assert_array_equal(join.attributes([("d", 0), ("unknown", 0)]),
                                  [vector[len(features):], feature_vector(features)[len(features):]])


# -- the shared event-time state machine (every engine runs it, or its batch twin) --------------


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
    state, got, late = PartitionWindows(fs), {}, 0
    for t, row in readings:
        accepted, closed = state.add("e", t, row)
        late += not accepted
        for c in closed:
            got[c["window_start"]] = {k: v for k, v in c.items()
                                      if k not in ("entity", "start", "window", "window_start", "window_end")}
    expected, expected_late = _reference(readings, fs)
    assert late == expected_late > 0
    assert got.keys() == expected.keys()
    for start in expected:
        assert got[start]["count"] == expected[start]["count"]
        for name in FEATURE_SET.aggregate_names:
            assert got[start][name] == pytest.approx(expected[start][name], rel=1e-12, abs=1e-15), (start, name)


def test_a_window_already_closed_before_a_restart_is_not_opened_again():
    state = PartitionWindows(FEATURE_SET, closed_through=10_000)
    assert state.add("e", 9_900, [1.0] * len(SENSORS)) == (False, [])
    accepted, closed = state.add("e", 10_100, [1.0] * len(SENSORS))
    assert accepted and closed == []


def test_the_stream_time_is_the_partitions_a_quiet_entity_does_not_hold_its_windows():
    state, row = PartitionWindows(FEATURE_SET), [1.0] * len(SENSORS)
    state.add("quiet", 1_000, row)
    state.add("busy", 1_000, row)
    accepted, closed = state.add("busy", 6_000, row)  # 5 s + 1 s of lateness: both first windows close
    assert accepted and [(c["entity"], c["start"]) for c in closed] == [("busy", 0), ("quiet", 0)]
    assert state.add("quiet", 4_500, row) == (False, [])  # the partition's time passed it: late
    assert [(c["entity"], c["start"]) for c in state.close_all()] == [("busy", 5_000)]  # quiet partition
    assert state.add("busy", 9_999, row) == (False, []) and state.closed_through == 10_000


# -- the embedded engine's batch twin of the state machine ---------------------------------------


def test_features_of_many_windows_at_once_equal_those_of_each_window():
    rng = np.random.default_rng(11)
    windows = []
    for i in range(120):
        values = rng.normal(10, 2, (int(rng.integers(1, 70)), len(SENSORS))) * rng.uniform(0.01, 1000)
        values[rng.random(values.shape) < rng.uniform(0, 0.7)] = np.nan
        if i % 9 == 0:
            values[:, 1] = 3.25  # a flat signal: no spectral energy
        windows.append(values)
    bounds = np.concatenate(([0], np.cumsum([len(w) for w in windows])))
    got = compute_windows(FEATURE_SET, np.concatenate(windows), bounds)
    for i, values in enumerate(windows):
        expected = window_features(values, FEATURE_SET.sample_hz)
        assert got[i] == pytest.approx([expected[n] for n in FEATURE_SET.aggregate_names], rel=1e-12, abs=1e-12), i


def _stream(seed: int, entities: int, readings: int) -> list[tuple[str, int, list[float]]]:
    """Interleaved readings of several entities at 10 Hz with disorder, stragglers, late ones, gaps and skewed clocks."""
    rng = np.random.default_rng(seed)
    clocks = {f"e{i}": int(rng.integers(0, 20_000)) for i in range(entities)}
    out = []
    for _ in range(readings):
        entity = f"e{int(rng.integers(entities))}"
        clocks[entity] += int(rng.choice([100, 100, 100, 3000]))
        ts = clocks[entity] - int(rng.choice([0, 0, 0, 0, 250, 1200, 9000]))  # in order, swapped, straggling, late
        row = list(rng.normal(10, 2, len(SENSORS)))
        if rng.random() < 0.1:
            row[int(rng.integers(len(SENSORS)))] = np.nan
        out.append((entity, ts, row))
    return out


@pytest.mark.parametrize(("seed", "hop_ms"), [(1, 5000), (2, 5000), (3, 1000), (4, 2500)])
def test_batch_windows_decide_as_the_per_reading_state_machine(seed, hop_ms):
    fs = FEATURE_SET.model_copy(update={"window": FEATURE_SET.window.model_copy(update={"hop_ms": hop_ms})})
    stream = _stream(seed, entities=9, readings=3000)
    partition_of = {f"e{i}": i % 3 for i in range(9)}
    reference, late_reference = {}, []
    states = {p: PartitionWindows(fs, closed_through=5000, stream_time=6000) for p in range(3)}
    for i, (entity, ts, row) in enumerate(stream):
        accepted, closed = states[partition_of[entity]].add(entity, ts, row)
        late_reference.append(not accepted)
        reference.update({(c["entity"], c["window_start"]): c for c in closed})
        if i == 2000:  # partition 1 goes quiet for a while
            reference.update({(c["entity"], c["window_start"]): c for c in states[1].close_all()})
    windows, late, got = BatchWindows(fs, offset=lambda offset: offset), [], {}
    for p in range(3):
        windows.start(p, closed_through=5000)
    rng = np.random.default_rng(seed)
    at = 0

    def collect(closed: list) -> None:
        if closed:
            counts, features = windows.features(closed)
            for c, count, row in zip(closed, counts, features):
                assert (c.entity, c.start) not in got, "a window closed twice"
                got[(c.entity, c.start)] = {"count": int(count), **dict(zip(fs.feature_names, row))}

    while at < len(stream):
        batch = stream[at:at + min(int(rng.integers(1, 300)), 2001 - at if at <= 2000 else 300)]
        names = [e for e, _, _ in batch]
        result = windows.add(windows.ids(names), np.array([partition_of[e] for e in names]),
                             np.array([t for _, t, _ in batch]), np.array([r for _, _, r in batch]),
                             list(range(at, at + len(batch))))
        late += result.late.tolist()
        collect(result.closed)
        at += len(batch)
        if at == 2001:
            collect(windows.close_partition(1))
    assert late == late_reference and sum(late) > 0
    assert got.keys() == reference.keys() and len(got) > 50
    for key, row in got.items():
        assert row["count"] == reference[key]["count"]
        assert row == pytest.approx({n: reference[key][n] for n in row}, rel=1e-12, abs=1e-12), key


def test_the_first_open_offset_of_a_partition_follows_its_open_windows():
    windows = BatchWindows(FEATURE_SET, offset=lambda handle: handle[1])
    windows.start(0)
    windows.start(1)
    row = [1.0] * len(SENSORS)

    def add(entity: str, ts: int, offset: int, partition: int) -> list:
        return windows.add(windows.ids([entity]), np.array([partition]), np.array([ts]), np.array([row]),
                           [(partition, offset)]).closed

    add("a", 1000, 10, 0)
    add("b", 1000, 20, 1)
    add("a", 5500, 11, 0)  # a's second window opens at offset 11; its first still open (lateness)
    assert windows.first_open_offset(0) == 10 and windows.first_open_offset(1) == 20
    assert [(c.entity, c.start, c.closer) for c in add("a", 6100, 12, 0)] == [("a", 0, (0, 12))]
    assert windows.first_open_offset(0) == 11 and windows.first_open_offset(2) is None
    assert windows.closed_through(0) == 5000 and windows.closed_through(1) == 0  # stream time 1000: end 0 + 1 s
    windows.forget({0})
    assert windows.first_open_offset(0) is None and windows.unknown(np.array([0, 1])) == [0]
    assert windows.first_open_offset(1) == 20


def test_the_model_card_records_the_accuracy_with_and_without_the_attributes_and_with_the_defaults():
    """`tangram models build` (make setup) trained the served model on the full vector and, for comparison, the same
    training on the aggregates alone; both are scored on the same held-out windows, the first also joined with the
    defaults (an unregistered device)."""
    card = json.loads((PM / "model_repository" / "anomaly" / "model_card.json").read_text())
    assert card["features"] == list(FEATURE_NAMES) and card["attributes"] == list(FEATURE_SET.attribute_names)
    assert 0 < card["attribute_defaults_share"] < 1
    for key in ("metrics", "metrics_without_attributes", "metrics_with_defaults"):
        metrics = card[key]
        assert 0.9 < metrics["accuracy"] <= 1.0, (key, metrics)
        assert sum(c["support"] for c in metrics["per_class"].values()) == card["test_windows"] > 1000
        assert all(0 <= c["precision"] <= 1 and 0 <= c["recall"] <= 1 for c in metrics["per_class"].values())


def test_the_demo_scoreboard_shows_the_served_models_accuracy_with_and_without_the_attributes(tmp_path):
    """The runtime hands the app's scorer the cards of the models the stack serves (it reads files, imports no app);
    the app's scorer puts the accuracy figures beside the filtered count."""
    stack = StackSettings(home=tmp_path, model_repository=tmp_path / "models")
    shutil.copytree(PM / "model_repository" / "anomaly", stack.model_repository / "anomaly")
    cards = served_cards(pm_topology(), stack)
    card = json.loads((PM / "model_repository" / "anomaly" / "model_card.json").read_text())
    assert cards == {"anomaly": card}

    simulator = FleetSimulator(pm_topology(), FleetSettings(), entities=12, seed=3)
    for step in range(300):  # 30 s: one device is taken out of service at 20 s
        simulator.tick(step, 0)
    truth = [label for _, label in simulator.truth(0)]
    board = simulator.score(Observed(start_ms=0, truth=truth, filtered={"status=maintenance": 90}, model_cards=cards))
    expected = " / ".join(f"{card[k]['accuracy']:.4f}"
                          for k in ("metrics", "metrics_without_attributes", "metrics_with_defaults"))
    assert board.figures["anomaly held-out accuracy with / without attributes / with defaults"] == expected
    filtered = next(i for i, n in enumerate(board.notes) if n.startswith("readings of devices not online"))
    sent = simulator.fleet.sent_not_online["status=maintenance"]
    assert sent == 100 and board.notes[filtered] == ("readings of devices not online (status=maintenance): 100 sent, "
                                                     "90 filtered out by the feature stage")
    again = simulator.score(Observed(start_ms=0, truth=truth, filtered={"status=maintenance": 129}, model_cards=cards))
    assert any(n.endswith("129 filtered out by the feature stage (29 more than sent: an earlier run's readings on "
                          "this stack, read again as the feature stage started)") for n in again.notes)
    assert board.notes[filtered + 1].startswith(f"model anomaly v1 ({card['dataset_version']}), held-out accuracy "
                                                f"over {card['test_windows']:,} windows: ")
    assert "rated_temperature, rated_current, rated_rpm" in board.notes[filtered + 1]
    # a card of another training script (no comparison in it) adds nothing, and no card at all neither
    for other in ({"anomaly": {"metrics": {"accuracy": 0.9}}}, {}):
        board = simulator.score(Observed(start_ms=0, truth=truth, model_cards=other))
        assert not any("accuracy" in k for k in board.figures) and not any("held-out" in n for n in board.notes)


def test_closed_windows_give_up_their_readings_at_the_next_batch():
    """The open windows' readings live in columns, a row per reading and window: the rows of the windows a batch
    closed are read by ``features`` and dropped by the next ``add``, so the columns hold the open windows only,
    and features asked for later are refused rather than computed from rows that are gone."""
    windows = BatchWindows(FEATURE_SET, offset=lambda offset: offset)
    windows.start(0)
    row = [1.0] * len(SENSORS)

    def add(entities: list[str], ts: list[int]) -> list:
        at = windows.rows.n
        return windows.add(windows.ids(entities), np.zeros(len(ts), dtype=np.int64), np.array(ts),
                           np.array([row] * len(ts)), list(range(at, at + len(ts)))).closed

    add(["a", "b", "a"], [1_000, 1_100, 1_200])
    add(["a", "b"], [5_100, 5_200])  # second windows open; the first stay open for the lateness
    assert windows.rows.n == 5
    closed = add(["b"], [6_000])  # stream time 6 s: the first windows close
    assert sorted((c.entity, c.start, c.last) for c in closed) == [("a", 0, 2), ("b", 0, 1)]
    counts, _ = windows.features(closed)
    assert sorted(counts.tolist()) == [1, 2] and windows.rows.n == 6
    add(["a"], [6_100])
    assert windows.rows.n == 4  # the closed windows' three rows are gone: a 5,100 / 6,100, b 5,200 / 6,000
    with pytest.raises(ValueError, match="closed before the last add"):
        windows.features(closed)
