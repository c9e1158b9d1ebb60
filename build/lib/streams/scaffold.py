"""``tangram init NAME``: a new app folder that runs end to end as it is.

The app reads JSON events ``{event_id, entity, ts, value}`` from ``<name>.raw.events``, validates
them into Avro (``ingest``), computes 5 s windows per entity (``features``: mean, std, min, max of
``value``), scores each window with a tiny ONNX model served by Triton (``inference``: P(high)
rises with the window's mean, around ``THRESHOLD``) and raises an ``alert`` action when a window
is scored ``high`` (``rules``). Everything is a declaration of the folder, ready to edit:

    <name>/topology.yaml             topics, processors, their params and constraints
    <name>/schemas/*.avsc            the Avro contracts (+ compatibility.yaml)
    <name>/features/window.yaml      the feature set
    <name>/model_repository/<name>_score/   config.pbtxt and labels.txt (1/model.onnx is built)
    <name>/<name>_app/model.py       the `models.build` hook that writes the tiny model
    <name>/README.md                 how to run it

Nothing here is specific to the reference apps: the same runtime runs this folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from streams.errors import TopologyError
from streams.features.spec import FeatureSet, load_feature_set

#: The window mean above which the scaffolded model says ``high``.
THRESHOLD = 50.0

_TIME = {"type": "long", "logicalType": "timestamp-millis"}


def _record(name: str, app: str, doc: str, fields: list[dict]) -> str:
    return json.dumps({"type": "record", "name": name, "namespace": f"{app}.contracts", "doc": doc,
                       "fields": fields}, indent=2) + "\n"


def _schemas(app: str, fs: FeatureSet) -> dict[str, str]:
    event = _record("Event", app, "One event of one entity.", [
        {"name": "event_id", "type": "string", "doc": "Unique per event: the dedup key."},
        {"name": "entity", "type": "string", "doc": "What the event is about; also the Kafka key."},
        {"name": "ts", "type": _TIME, "doc": "Event time."},
        {"name": "value", "type": ["null", "double"], "default": None, "doc": "The measurement; null when missing."},
    ])
    window = _record("Window", app, "Features of one entity over one event-time window.", [
        {"name": "entity", "type": "string"},
        {"name": "window_start", "type": _TIME},
        {"name": "window_end", "type": _TIME},
        {"name": "count", "type": "int"},
        *({"name": feature, "type": "double"} for feature in fs.feature_names),
    ])
    prediction = _record("Prediction", app, "The model's verdict on one window.", [
        {"name": "event_id", "type": "string"},
        {"name": "entity", "type": "string"},
        {"name": "window_start", "type": _TIME},
        {"name": "window_end", "type": _TIME},
        {"name": "score", "type": "double"},
        {"name": "label", "type": "string"},
        {"name": "confidence", "type": "double"},
        {"name": "probabilities", "type": {"type": "map", "values": "double"}},
        {"name": "model_name", "type": "string"},
        {"name": "model_version", "type": "string"},
        {"name": "inference_ms", "type": "double"},
        {"name": "trace_id", "type": "string"},
    ])
    action = _record("Action", app, "A decision for a subscriber: the rule, its inputs and the model behind it.", [
        {"name": "event_id", "type": "string"},
        {"name": "action_type", "type": "string"},
        {"name": "entity", "type": "string"},
        {"name": "rule", "type": "string"},
        {"name": "reason", "type": "string"},
        {"name": "inputs", "type": {"type": "map", "values": "double"}},
        {"name": "label", "type": "string"},
        {"name": "score", "type": "double"},
        {"name": "model_name", "type": "string"},
        {"name": "model_version", "type": "string"},
        {"name": "window_end", "type": _TIME},
        {"name": "degradation_level", "type": "string", "default": "L0"},
        {"name": "trace_id", "type": "string"},
        {"name": "model_versions", "type": {"type": "map", "values": "string"}, "default": {}},
        {"name": "missing_models", "type": {"type": "array", "items": "string"}, "default": []},
        {"name": "rule_set", "type": "string", "default": ""},
    ])
    return {f"{app}.ingest.events-value": event, f"{app}.features.window-value": window,
            f"{app}.predictions.score-value": prediction, f"{app}.actions.alert-value": action}


FEATURE_SET = """\
# The app's feature set, declared once: the features processor computes it, the model reads it
# in this order (append, never reorder).
name: window
version: 1
owner: {app}-team@example.com
description: Per-entity statistics of `value` over 5 s event-time windows.
entity: {{name: entity, join_key: entity}}
source: {{topic: {app}.ingest.events, schema: {app}.ingest.events-value, timestamp_field: ts}}
output: {{topic: {app}.features.window, schema: {app}.features.window-value}}
window: {{size_ms: 5000, hop_ms: 5000, allowed_lateness_ms: 1000}}
sample_hz: 1.0
inputs: [value]
aggregations:
  - {{kind: stats, inputs: [value], stats: [mean, std, min, max]}}
ranges:
  value: [0.0, 1000.0]
online: {{ttl_s: 3600}}
"""

TOPOLOGY = """\
# The app `{app}`, scaffolded by `tangram init`: JSON events → Avro → 5 s windows → a model on
# Triton → an alert when a window scores `high`. Every path here is relative to this folder.
#   tangram models build .   tangram apply .   tangram run . <processor>   (see README.md)
app: {app}
description: Events of entities, windowed, scored by a model, alerts on high windows.
schemas: schemas
models:
  repository: model_repository
  build: {app}_app.model:build

topics:
  {app}.raw.events: {{format: json, description: "Events as producers send them (JSON)."}}
  {app}.ingest.events: {{schema: {app}.ingest.events-value, description: Validated events.}}
  {app}.features.window: {{schema: {app}.features.window-value, description: Per-entity window features.}}
  {app}.predictions.score: {{schema: {app}.predictions.score-value, description: The model's verdicts.}}
  {app}.actions.alert: {{schema: {app}.actions.alert-value, description: Alerts for subscribers.}}
  {app}.dlq.ingest: {{format: bytes, description: Refused events with the reason in the headers.}}
  {app}.dlq.features: {{format: bytes}}
  {app}.dlq.inference: {{format: bytes}}
  {app}.dlq.rules: {{format: bytes}}

processors:
  ingest:
    kind: streams.ingest:IngestValidator
    inputs: [{app}.raw.events]
    outputs: [{app}.ingest.events]
    dlq: {app}.dlq.ingest
    params:
      entity_field: entity
      time_field: ts
      ranges: {{value: [0.0, 1000.0]}}
  features:
    kind: streams.features:WindowFeatures
    inputs: [{app}.ingest.events]
    outputs: [{app}.features.window]
    dlq: {app}.dlq.features
    params: {{feature_set: features/window.yaml}}
  inference:
    kind: inference_workers.worker:InferenceWorker
    inputs: [{app}.features.window]
    outputs: [{app}.predictions.score]
    dlq: {app}.dlq.inference
    batch_size: 64
    params: {{model: {app}_score, feature_set: features/window.yaml, negative_class: normal}}
  rules:
    kind: streams.rules:RuleProcessor
    inputs: [{app}.predictions.score]
    outputs: [{app}.actions.alert]
    dlq: {app}.dlq.rules
    params:
      entity_field: entity
      actions: {{alert: {app}.actions.alert}}
      live_config: false
      rules:
        - {{name: high_value, when: "label == 'high' and confidence >= 0.9", action: alert}}
"""

CONFIG = """\
# The model of app `{app}` (model names are global on a Triton server: hence the app's prefix): one input (the feature set's {n} features, in order), one output (the
# probability of each label in labels.txt). 1/model.onnx is written by `tangram models build`.
name: "{app}_score"
platform: "onnxruntime_onnx"
max_batch_size: 256
input [ {{ name: "features", data_type: TYPE_FP32, dims: [ {n} ] }} ]
output [ {{ name: "probabilities", data_type: TYPE_FP32, dims: [ 2 ], label_filename: "labels.txt" }} ]
dynamic_batching {{ max_queue_delay_microseconds: 1000 }}
instance_group [ {{ count: 1 }} ]
"""

MODEL = '''\
"""The `models.build` hook of app `{app}`: a tiny ONNX model, P(high) = sigmoid(mean - {threshold:g}).

Replace it with your own training or export script: it gets the repository folder to write
`<model>/<version>/...` into, and returns a line for the operator.
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FEATURES = {features!r}


def build(repository: Path, force: bool = False) -> str:
    target = repository / "{app}_score" / "1" / "model.onnx"
    if target.is_file() and not force:
        return f"{app}_score v1 already built in {{repository}}"
    weights = np.zeros((len(FEATURES), 2), dtype=np.float32)
    weights[FEATURES.index("value_mean"), 1] = 1.0  # logit(high) - logit(normal) = mean - threshold
    bias = np.array([0.0, -{threshold}], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "w"], ["logits0"]),
         helper.make_node("Add", ["logits0", "b"], ["logits"]),
         helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1)],
        "{app}_score",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", len(FEATURES)])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(model.SerializeToString())
    return f"{app}_score v1 written to {{target}}"
'''

README = """\
# {app}

Scaffolded by `tangram init {app}`. JSON events `{{"event_id", "entity", "ts", "value"}}` on
`{app}.raw.events` → validated (`ingest`) → 5 s windows per entity (`features`) → a model on
Triton (`inference`) → an `alert` on `{app}.actions.alert` when a window's mean `value` is above
{threshold:g} (`rules`).

```bash
tangram up                                   # the local stack (Kafka, registry, Redis, Triton)
tangram models build {folder}                # writes model_repository/{app}_score/1/model.onnx
tangram apply {folder}                       # topics, schemas, the model into Triton
for p in ingest features inference rules; do tangram run {folder} $p & done
```

Produce an event (any Kafka client; the key is the entity):
`{{"event_id": "e1", "entity": "sensor-1", "ts": <epoch ms>, "value": 80.0}}` — a window whose mean
is above {threshold:g} leads to an alert once a later event closes it. Edit the schemas, the
feature set, the model and the rules; `tangram plan {folder}` shows what `apply` would change.
"""


def scaffold(name: str, folder: Path) -> Path:
    """Write a new app called ``name`` into ``folder`` (which must not exist or be empty)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise TopologyError(f"app name {name!r}: lowercase letters, digits and _, starting with a letter")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise TopologyError(f"{folder} exists and is not empty: choose another folder (--dir)")
    (folder / "features").mkdir(parents=True, exist_ok=True)
    feature_set = folder / "features" / "window.yaml"
    feature_set.write_text(FEATURE_SET.format(app=name))
    fs = load_feature_set(feature_set)
    (folder / "schemas").mkdir()
    for subject, text in _schemas(name, fs).items():
        (folder / "schemas" / f"{subject}.avsc").write_text(text)
    (folder / "schemas" / "compatibility.yaml").write_text(
        "# Compatibility level of each subject (Confluent's names); `tangram schemas check` enforces them.\n"
        "default: BACKWARD\n")
    model = folder / "model_repository" / f"{name}_score"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG.format(app=name, n=len(fs.feature_names)))
    (model / "labels.txt").write_text("normal\nhigh\n")
    plugin = folder / f"{name}_app"
    plugin.mkdir()
    (plugin / "__init__.py").write_text(f'"""Plugin code of app `{name}`."""\n')
    (plugin / "model.py").write_text(MODEL.format(app=name, threshold=THRESHOLD, features=list(fs.feature_names)))
    (folder / "topology.yaml").write_text(TOPOLOGY.format(app=name))
    (folder / "README.md").write_text(README.format(app=name, folder=folder, threshold=THRESHOLD))
    return folder
