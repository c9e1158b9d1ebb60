"""The drift job: a processor of the one delivery loop over the feature and prediction topics.

Every feature record (``DeviceWindow``) joins a sliding window of the last ``window`` feature
rows; every prediction (``AnomalyPrediction``) a window of predictions. Every ``step`` records a
window is tested against the training baseline (``streams.monitor.baseline``): each feature by
KS and PSI (every feature of the baseline, or with ``compare: aggregates`` only its feature set's
window aggregates: a table attribute is constant per entity and says which entities a window holds,
not how they behave), the predicted labels by chi-square and PSI, the confidences by KS and PSI. Each
result is a ``DriftResult`` on ``pm.monitor.drift`` and a set of gauges; a drift that lasts
``consecutive`` evaluations also becomes an ``Action`` (``alert``, rule ``drift``, device
``fleet``) on the alert topic.

Thresholds are live: ``monitor-threshold`` keys ``drift.ks_pvalue``, ``drift.psi`` and
``drift.consecutive`` in the config center override the topology's defaults without a restart.

State: the windows live in memory and are not rebuilt after a restart; the first evaluation of
a restarted job comes ``window`` records later. Its outputs are at-least-once like any other
processor's, with deterministic ``event_id``s.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from pathlib import Path
from typing import Literal

from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field, model_validator

from streams.avro import AvroCodec
from streams.wire import WireFormatError
from streams.config_center import ConfigSubscriber
from streams.config_center.center import CONFIG_TOPIC
from streams.context import BuildContext
from streams.delivery import H_EVENT_ID, H_TRACE_ID, Output, Processor, Record, dead_letter
from streams.errors import DriftBaselineError, TopologyError
from streams.features.spec import load_feature_set
from streams.lifecycle.repository import CARD_FILE
from streams.monitor.baseline import Baseline, load_baseline
from streams.monitor.stats import DriftDetector, Evaluation, FeatureVerdict, NumericReference, Thresholds
from streams.security.kafka import KafkaConnection
from streams.statelog import StateTopic

log = logging.getLogger("tangram.monitor.drift")

KS = Gauge("tangram_monitor_drift_ks_statistic", "Latest KS statistic (chi-square for labels) of a feature against "
           "the training baseline.", ["processor", "monitor", "feature"])
PVALUE = Gauge("tangram_monitor_drift_pvalue", "Latest p-value of a feature's drift test.",
               ["processor", "monitor", "feature"])
PSI = Gauge("tangram_monitor_drift_psi", "Latest population stability index of a feature.",
            ["processor", "monitor", "feature"])
FLAGGED = Gauge("tangram_monitor_drift_flagged", "1 while a feature's latest evaluation is drifted.",
                ["processor", "monitor", "feature"])
CONSECUTIVE = Gauge("tangram_monitor_drift_consecutive", "Evaluations in a row a feature has been drifted.",
                    ["processor", "monitor", "feature"])
EVALUATIONS = Counter("tangram_monitor_drift_evaluations_total", "Sliding-window evaluations.", ["processor", "monitor"])
ALERTS = Counter("tangram_monitor_drift_alerts_total", "Sustained drifts raised as alert actions.",
                 ["processor", "monitor", "feature"])
EVALUATION_SECONDS = Histogram("tangram_monitor_drift_evaluation_seconds", "Time to test one window, every feature.",
                               ["processor", "monitor"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
CONFIDENCE = Histogram("tangram_monitor_prediction_confidence", "Confidence (P(label)) of the predictions seen.",
                       ["model", "version"], buckets=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0))
PREDICTIONS = Counter("tangram_monitor_predictions_total", "Predictions seen, by model version and label.",
                      ["model", "version", "label"])

FEATURES, PREDICTIONS_MONITOR = "features", "predictions"
THRESHOLD_KEYS = {"ks_pvalue": "drift.ks_pvalue", "psi": "drift.psi", "consecutive": "drift.consecutive"}


class DriftSettings(BaseModel):
    """The ``params`` of a drift processor in a topology."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Model whose card (in the stack's model repository) holds the baseline.")
    drift_topic: str = Field(description="The output that gets every evaluation (DriftResult records).")
    alert_topic: str = Field(description="The output that gets sustained-drift alerts (the rules' action contract).")
    entity_field: str = Field(description="The entity field of the alert actions.")
    time_field: str = Field("window_end", description="The time field of the alert actions.")
    alert_entity: str = Field("drift", description="The entity (and key) of drift alert actions.")
    window: int = Field(300, ge=20, le=100_000, description="Records in the sliding window.")
    step: int = Field(100, ge=1, description="Records between two evaluations.")
    bins: int = Field(10, ge=2, le=100, description="Quantile bins of the PSI.")
    thresholds: Thresholds = Field(Thresholds(), description="Defaults; the config center overrides them live.")
    config_center: bool = Field(True, description="Follow `monitor-threshold` in the config center.")
    compare: Literal["all", "aggregates"] = Field(
        "all", description="The features of a window tested: every one of the baseline, or only the window "
                           "aggregates of `feature_set`, not the table attributes it appends (constant per entity, "
                           "their distribution over a window says which entities it holds, not how they behave).")
    feature_set: str | None = Field(None, description="The feature set of the monitored windows (YAML, relative to "
                                                      "the app folder), for `compare: aggregates`.")

    @model_validator(mode="after")
    def _step_fits(self) -> DriftSettings:
        if self.step > self.window:
            raise ValueError(f"step {self.step} is larger than window {self.window}")
        if self.compare == "aggregates" and self.feature_set is None:
            raise ValueError("compare: aggregates needs `feature_set:`, whose aggregates are compared")
        return self


def result_id(monitor: str, feature: str, evaluation: int, window_end: int) -> str:
    return hashlib.sha256(f"{monitor}|{feature}|{evaluation}|{window_end}".encode()).hexdigest()[:32]


class DriftMonitor(Processor):
    """Feature windows and predictions → ``DriftResult`` records, gauges and sustained-drift alerts."""

    name = "drift"
    needs_models = True  # the model card and its baseline sample

    def __init__(self, *, codecs: dict[str, AvroCodec], monitors: dict[str, str], drift_topic: str, alert_topic: str,
                 dlq_topic: str, card_path: Path, settings: DriftSettings, kafka: KafkaConnection | None = None,
                 compared: tuple[str, ...] | None = None):
        self.codecs = codecs
        self.compared = compared  # the features tested (``compare: aggregates``); None: every one of the baseline
        self.monitors = monitors  # input topic → "features" | "predictions"
        self.drift_topic = drift_topic
        self.alert_topic = alert_topic
        self.dlq_topic = dlq_topic
        self.card_path = card_path
        self.settings = settings
        self.kafka = kafka
        self.config: ConfigSubscriber | None = None
        self.baseline: Baseline | None = None
        self.detectors: dict[str, DriftDetector] = {}

    @classmethod
    def build(cls, ctx: BuildContext) -> DriftMonitor:
        settings = ctx.settings(DriftSettings)
        for topic in (settings.drift_topic, settings.alert_topic):
            if topic not in ctx.spec.outputs:
                raise TopologyError(f"drift processor {ctx.name!r}: {topic!r} is not one of its outputs {ctx.spec.outputs}")
        codecs = {t: ctx.codec(t) for t in [*ctx.spec.inputs, settings.drift_topic, settings.alert_topic]}
        # a topic whose contract carries `model_name` holds predictions; any other, feature windows
        monitors = {t: PREDICTIONS_MONITOR if any(f["name"] == "model_name" for f in codecs[t].schema_json["fields"])
                    else FEATURES for t in ctx.spec.inputs}
        compared = (load_feature_set(ctx.path(settings.feature_set)).aggregate_names
                    if settings.compare == "aggregates" and settings.feature_set else None)
        return cls(codecs=codecs, monitors=monitors, drift_topic=settings.drift_topic,
                   alert_topic=settings.alert_topic, dlq_topic=ctx.dlq,
                   card_path=ctx.stack.model_repository / settings.model / CARD_FILE, settings=settings,
                   kafka=ctx.stack.kafka if settings.config_center else None, compared=compared)

    # -- lifecycle -------------------------------------------------------------------
    def setup(self) -> None:
        self.baseline = baseline = load_baseline(self.card_path)
        s = self.settings
        if FEATURES in self.monitors.values():
            names = list(baseline.features) if self.compared is None else list(self.compared)
            if lacking := [n for n in names if n not in baseline.features]:
                raise DriftBaselineError(f"{self.name}: the baseline of {baseline.model_name} v{baseline.model_version} "
                                         f"has no sample of {lacking}: retrain the model on the feature set compared")
            refs = {name: NumericReference.of(baseline.features[name], s.bins) for name in names}
            self.detectors[FEATURES] = DriftDetector(refs, window=s.window, step=s.step)
        if PREDICTIONS_MONITOR in self.monitors.values():
            self.detectors[PREDICTIONS_MONITOR] = DriftDetector(
                {"confidence": NumericReference.of(baseline.confidence, s.bins)},
                {"label": baseline.label_shares}, window=s.window, step=s.step)
        if self.kafka:
            StateTopic(self.kafka, CONFIG_TOPIC).ensure()
            self.config = ConfigSubscriber(self.kafka, name=self.name,
                                           namespaces=["monitor-threshold", "feature-switch"]).start()
        log.info("%s: watching %s against %s v%s (dataset %s), window %d, step %d", self.name,
                 ", ".join(f"{t} ({m})" for t, m in self.monitors.items()), baseline.model_name,
                 baseline.model_version, baseline.dataset_version, s.window, s.step)

    def close(self) -> None:
        if self.config is not None:
            self.config.stop()

    # -- thresholds --------------------------------------------------------------------
    def thresholds(self) -> Thresholds:
        """The topology's defaults, overridden by ``monitor-threshold`` values in the config center."""
        base = self.settings.thresholds
        if self.config is None:
            return base
        values = {}
        for field, key in THRESHOLD_KEYS.items():
            value = self.config.get("monitor-threshold", key)
            if value is not None:
                values[field] = int(value) if field == "consecutive" else float(value)
        if not values:
            return base
        try:
            return Thresholds.model_validate({**base.model_dump(), **values})
        except ValueError as exc:
            log.warning("%s: config-center thresholds %s refused (%s); keeping %s", self.name, values, exc, base)
            return base

    # -- the loop's hooks -----------------------------------------------------------------
    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        rows: dict[str, list[dict]] = {FEATURES: [], PREDICTIONS_MONITOR: []}
        for record in batch:
            monitor = self.monitors.get(record.topic)
            try:
                value = self.codecs[record.topic].decode(record.value)
            except (WireFormatError, KeyError) as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
                continue
            if monitor == PREDICTIONS_MONITOR:
                CONFIDENCE.labels(value["model_name"], value["model_version"]).observe(value["confidence"])
                PREDICTIONS.labels(value["model_name"], value["model_version"], value["label"]).inc()
            rows[monitor].append({**value, "ts_ms": value[self.settings.time_field]})
        thresholds = self.thresholds()
        for monitor, detector in self.detectors.items():
            if not rows[monitor]:
                continue
            started = time.perf_counter()
            evaluations = detector.add(rows[monitor], thresholds)
            for evaluation in evaluations:
                outputs.extend(self._report(monitor, evaluation, thresholds))
            if evaluations:
                EVALUATION_SECONDS.labels(self.name, monitor).observe((time.perf_counter() - started) / len(evaluations))
        return outputs

    def _report(self, monitor: str, evaluation: Evaluation, thresholds: Thresholds) -> list[Output]:
        baseline = self.baseline
        assert baseline is not None, "setup() builds the baseline before the first batch"
        EVALUATIONS.labels(self.name, monitor).inc()
        config_version = self.config.version if self.config is not None else 0
        now = int(time.time() * 1000)
        out = []
        for v in evaluation.verdicts:
            labels = (self.name, monitor, v.feature)
            KS.labels(*labels).set(v.result.statistic)
            PVALUE.labels(*labels).set(v.result.pvalue)
            PSI.labels(*labels).set(v.result.psi)
            FLAGGED.labels(*labels).set(1 if v.flagged else 0)
            CONSECUTIVE.labels(*labels).set(v.consecutive)
            event_id = result_id(monitor, v.feature, evaluation.index, evaluation.end_ms)
            record = {
                "event_id": event_id, "monitor": monitor, "feature": v.feature, "test": v.result.test,
                "statistic": v.result.statistic, "pvalue": v.result.pvalue, "psi": v.result.psi,
                "drifted": v.flagged, "consecutive": v.consecutive, "sustained": v.alert,
                "evaluation": evaluation.index, "window_rows": evaluation.rows, "window_start": evaluation.start_ms, "window_end": evaluation.end_ms,
                "model_name": baseline.model_name, "model_version": baseline.model_version,
                "dataset_version": baseline.dataset_version,
                "thresholds": {k: float(x) for k, x in thresholds.model_dump().items()},
                "config_version": config_version, "evaluated_ms": now,
            }
            out.append(Output(self.drift_topic, f"{monitor}.{v.feature}", self.codecs[self.drift_topic].encode(record),
                              {H_EVENT_ID: event_id, H_TRACE_ID: uuid.uuid4().hex}))
            if v.alert:
                ALERTS.labels(*labels).inc()
                out.append(self._alert(monitor, v, evaluation, thresholds, event_id))
        return out

    def _alert(self, monitor: str, v: FeatureVerdict, evaluation: Evaluation, thresholds: Thresholds, result_event: str) -> Output:
        baseline = self.baseline
        assert baseline is not None
        level = self.config.get("feature-switch", "degradation.level", default="L0") if self.config else "L0"
        event_id = hashlib.sha256(f"drift|{result_event}".encode()).hexdigest()[:32]
        r = v.result
        reason = (f"sustained drift of {monitor}.{v.feature} against the training baseline "
                  f"({baseline.dataset_version}): {r.test} p={r.pvalue:.3g} < {thresholds.ks_pvalue:g} and "
                  f"PSI={r.psi:.3f} >= {thresholds.psi:g} for {v.consecutive} evaluations of {evaluation.rows} records")
        log.warning("%s: %s", self.name, reason)
        action = {
            "event_id": event_id, "action_type": "alert", self.settings.entity_field: self.settings.alert_entity,
            "rule": f"drift.{monitor}.{v.feature}", "reason": reason,
            "inputs": {"statistic": r.statistic, "pvalue": r.pvalue, "psi": r.psi, "consecutive": float(v.consecutive)},
            "label": "drift", "score": r.psi, "model_name": baseline.model_name,
            "model_version": baseline.model_version, self.settings.time_field: evaluation.end_ms,
            "degradation_level": str(level), "trace_id": uuid.uuid4().hex,
            "model_versions": {baseline.model_name: baseline.model_version}, "missing_models": [],
            "rule_set": f"config v{self.config.version}" if self.config is not None and self.config.version else "topology",
        }
        return Output(self.alert_topic, self.settings.alert_entity, self.codecs[self.alert_topic].encode(action),
                      {H_EVENT_ID: event_id, H_TRACE_ID: action["trace_id"]})
