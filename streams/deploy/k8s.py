"""``tangram deploy k8s``: a Helm chart for one topology.

Secured by default (docs/security.md): every processor is a Strimzi ``KafkaUser`` (SCRAM-SHA-512, the
ACLs ``streams.security.acls`` generates from the topology) and connects with the password the User
Operator puts in that user's Secret; the schema registry is Tangram's own, with basic auth and roles.

The templates (``chart/templates``, package data) are the same for every application; what differs is
``values.yaml``, computed here from the topology: each processor's replicas, consumer group and inputs,
its CPU request from the declared ``compute.target_utilization``, whether it may scale, every topic's
partitions, replication and configs, and whether Triton needs a GPU. The templates derive the
autoscaling bound from those topics (a processor never gets more replicas than its narrowest input has
partitions), so an edited values file cannot break it either. The Grafana dashboards are written into
the chart from ``streams.monitor.dashboards``, the same panels docker-compose provisions.
"""

from __future__ import annotations

import importlib.resources
import json
import shutil
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from streams import __version__
from streams.errors import TangramError, TopologyError
from streams.gateway.webapp import HEALTH_PATH
from streams.gateway.processes import LISTEN_PORTS, gateway_processes
from streams.monitor.dashboards import DASHBOARDS, PROCESSOR_METRICS_PORT, dashboard_json
from streams.payloads import payload_processors
from streams.security.acls import (
    gateway_principal, principal_grants, processor_principal, registry_grants, strimzi_acls,
)
from streams.security.local import REGISTRY_PRINCIPAL, REGISTRY_READER
from streams.settings import OPERATOR
from streams.topology import PayloadsSpec, ProcessorSpec, Topology

TEMPLATES = importlib.resources.files("streams.deploy") / "chart" / "templates"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.01-py3"      # docker-compose.yml's
REDIS_IMAGE = "redis:7"                                    # docker-compose.yml's
IMAGE_HOME = "/var/lib/tangram"                            # the Dockerfile's TANGRAM_HOME


class ChartSettings(BaseModel):
    """What the topology does not say about a cluster: where the image and the Kafka cluster are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    app_path: str = Field(description="The app (folder or topology file) inside the image, as `tangram run` takes it.")
    image: str = Field(f"tangram:{__version__}", description="The Tangram image, `repository:tag`.")
    kafka_cluster: str = Field("tangram", description="The Strimzi `Kafka` resource the topics belong to.")
    lag_threshold: int = Field(1000, ge=1, description="Consumer lag per replica at which KEDA adds one.")
    memory_request: str = Field("256Mi", description="Each processor replica's memory request.")
    memory_limit: str = Field("1Gi", description="Each processor replica's memory limit.")
    mqtt_broker: str = Field("mosquitto:1883", description="`host:port` of the MQTT broker the MQTT adapter "
                                                        "subscribes to (yours: the chart runs none).")
    payload_size: str = Field("10Gi", description="The payload store's claim (ReadWriteMany).")
    kafka_security: bool = Field(True, description="SASL_SSL (SCRAM-SHA-512) with a KafkaUser and ACLs per "
                                                   "processor; off: PLAINTEXT, no users.")


def _scales_with_partitions(topology: Topology, spec: ProcessorSpec) -> bool:
    """A processor that declares itself a singleton (the canary job decides per model) runs as one replica."""
    return not topology.load_object(spec.kind).singleton


def _gateway_values(topology: Topology, settings: ChartSettings) -> dict:
    """The app's gateway processes: the HTTP ones with a port, a Service and an HPA on CPU, the MQTT adapter
    with its broker and the Secret of its password there."""
    resources = {"requests": {"cpu": "250m", "memory": settings.memory_request},
                 "limits": {"cpu": "1", "memory": settings.memory_limit}}
    out: dict = {"principal": gateway_principal(topology), "healthPath": HEALTH_PATH}
    for kind, streams in gateway_processes(topology).items():
        if kind == "mqtt":
            host, _, port = settings.mqtt_broker.rpartition(":")
            out[kind] = {"enabled": True, "streams": streams, "broker": {"host": host, "port": int(port)},
                         "passwordSecret": {"name": f"{topology.app}-mqtt-gateway", "key": "password"},
                         "resources": resources}
        else:
            port = LISTEN_PORTS[kind]
            out[kind] = {"enabled": True, "streams": streams, "port": port, "replicas": 2,
                         "autoscaling": {"enabled": True, "maxReplicas": 6, "targetCPUUtilizationPercentage": 70},
                         "resources": resources, "service": {"type": "ClusterIP", "port": port}}
    return out


def _payload_values(topology: Topology, settings: ChartSettings) -> dict | None:
    """The payload store's claim, if the upload gateway or a processor reads or writes references: mounted
    where the image's TANGRAM_HOME puts the app's ``payloads.store`` (or at it, when absolute)."""
    if not topology.uploads and not payload_processors(topology):
        return None
    store = (topology.payloads or PayloadsSpec()).store
    mount = store if store.startswith("/") else f"{IMAGE_HOME}/{store}"
    return {"mountPath": mount, "size": settings.payload_size, "accessMode": "ReadWriteMany",
            "storageClassName": "", "existingClaim": ""}


def _processor_values(topology: Topology, name: str, settings: ChartSettings) -> dict:
    spec = topology.processors[name]
    bound = min(topology.partitions(topic) for topic in spec.inputs)
    if spec.replicas > bound:
        raise TopologyError(f"processor {name!r}: {spec.replicas} replicas but its narrowest input has {bound} "
                            "partitions; the extra replicas would sit idle")
    return {
        "replicas": spec.replicas,
        "principal": processor_principal(topology, name),
        "group": topology.group(name),
        "inputs": list(spec.inputs),
        "autoscaling": _scales_with_partitions(topology, spec),
        "needsModels": bool(topology.load_object(spec.kind).needs_models),
        "payloads": name in payload_processors(topology),
        "resources": {
            # one Python process is busy at most one core; the topology plans it at target_utilization of it
            "requests": {"cpu": f"{round(spec.compute.target_utilization * 1000)}m",
                         "memory": settings.memory_request},
            "limits": {"cpu": "1", "memory": settings.memory_limit},
        },
    }


def chart_values(topology: Topology, settings: ChartSettings) -> dict:
    """The chart's values.yaml as data: everything the templates need, from the topology and the settings."""
    repository, _, tag = settings.image.rpartition(":")
    gpu = any(spec.compute.device == "gpu" for spec in topology.processors.values()
              if any(call.service == "triton" for call in spec.calls))
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "app": {"name": topology.app, "path": settings.app_path},
        "metricsPort": PROCESSOR_METRICS_PORT,
        "kafka": {
            "cluster": settings.kafka_cluster,
            "host": f"{settings.kafka_cluster}-kafka-bootstrap",
            "port": 9093 if settings.kafka_security else 9092,
            "strimziTopics": True,
            "security": {
                "enabled": settings.kafka_security,
                "mechanism": "SCRAM-SHA-512",
                "caSecret": f"{settings.kafka_cluster}-cluster-ca-cert",
                "caKey": "ca.crt",
                "operator": OPERATOR,
            },
            # one KafkaUser per principal: its ACLs from the topology (the operator's: a super user of the cluster)
            "users": {
                **{p: {"acls": strimzi_acls(grants)} for p, grants in principal_grants(topology).items()},
                REGISTRY_PRINCIPAL: {"acls": strimzi_acls(registry_grants(REGISTRY_PRINCIPAL))},
                OPERATOR: {"acls": []},
            },
        },
        "autoscaling": {"enabled": True, "lagThreshold": settings.lag_threshold, "pollingInterval": 15,
                        "cooldownPeriod": 300},
        "processors": {name: _processor_values(topology, name, settings) for name in topology.processors},
        "gateways": _gateway_values(topology, settings),
        "payloads": _payload_values(topology, settings),
        "topics": {
            topic: {"partitions": topology.partitions(topic), "replicas": topology.replication(topic),
                    "config": topology.topic_configs(topic)}
            for topic in topology.topics
        },
        "triton": {
            "image": TRITON_IMAGE,
            "gpu": {"enabled": gpu, "count": 1},
            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
            "modelRepository": {"size": "2Gi", "storageClassName": ""},
            "nodeSelector": {},
            "tolerations": [],
        },
        "schemaRegistry": {
            "replicationFactor": topology.defaults.replication_factor,
            "principal": REGISTRY_PRINCIPAL,
            # users.json (`tangram registry-user`): the operator as admin, the reader as read-only
            "usersSecret": f"{topology.app}-registry-users",
            "reader": {"user": REGISTRY_READER, "secret": f"{topology.app}-registry-reader", "key": "password"},
            "admin": {"user": OPERATOR, "secret": f"{topology.app}-registry-admin", "key": "password"},
        },
        "redis": {"image": REDIS_IMAGE, "existingSecret": f"{topology.app}-redis", "secretKey": "password",
                  "storage": "1Gi"},
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {}},
        "dashboards": {"enabled": True, "labels": {"grafana_dashboard": "1"}},
    }


_VALUES_HEADER = """\
# Generated from {source} by `tangram deploy k8s`; render it again when the topology changes.
# image: the Tangram image (the wheel and the app folders); app.path: the app inside it.
# processors.<name>: replicas (the topology's), consumer group, inputs, resources, and whether KEDA may
#   scale it on consumer lag; the chart bounds that by the partitions of its narrowest input.
# topics: the Strimzi KafkaTopics (kafka.strimziTopics: false when topics are managed elsewhere).
# gateways: the app's HTTP and upload gateways (API keys, replicas, an HPA on CPU, a Service each) and its
#   MQTT adapter (one replica; gateways.mqtt.broker, and its password in gateways.mqtt.passwordSecret).
# payloads: the payload store's ReadWriteMany claim, mounted by the upload gateway and the processors that
#   read references (payloads.existingClaim: bring your own).
# triton.gpu.enabled: an `nvidia.com/gpu` limit for Triton (on when an inference processor declares gpu).
# kafka.security: SASL_SSL with SCRAM-SHA-512 on the cluster's SCRAM listener (kafka.port); kafka.users: a
#   Strimzi KafkaUser per principal with the topology's ACLs (the operator's must be a super user of the cluster).
# schemaRegistry: Tangram's registry with basic auth; create its users Secret (users.json) and the reader's
#   and admin's password Secrets first.
# redis.existingSecret: the Secret holding the Redis password (key redis.secretKey); create it first.
# serviceMonitor / dashboards: Prometheus Operator ServiceMonitors and Grafana dashboard ConfigMaps.
"""


def render_chart(topology: Topology, source: str, out: Path, settings: ChartSettings) -> list[Path]:
    """Write the chart for ``topology`` into ``out`` (replacing an earlier rendering); returns the files written."""
    if out.exists() and any(out.iterdir()) and not (out / "Chart.yaml").is_file():
        raise TangramError(f"{out} is not empty and holds no chart: give `--out` a new folder or an earlier chart's")
    for owned in ("templates", "dashboards"):
        shutil.rmtree(out / owned, ignore_errors=True)
        (out / owned).mkdir(parents=True)
    chart = {"apiVersion": "v2", "name": f"tangram-{topology.app.replace('_', '-')}", "version": __version__,
             "appVersion": __version__, "type": "application",
             "description": topology.description or f"Tangram topology {topology.app}"}
    written = [out / "Chart.yaml", out / "values.yaml"]
    written[0].write_text(yaml.safe_dump(chart, sort_keys=False, allow_unicode=True))
    written[1].write_text(_VALUES_HEADER.format(source=source)
                          + yaml.safe_dump(chart_values(topology, settings), sort_keys=False, allow_unicode=True))
    for template in TEMPLATES.iterdir():
        if template.name.endswith((".yaml", ".tpl")):
            path = out / "templates" / template.name
            path.write_text(template.read_text())
            written.append(path)
    for dashboard in DASHBOARDS:
        path = out / "dashboards" / f"{dashboard.uid}.json"
        path.write_text(json.dumps(dashboard_json(dashboard), indent=2, ensure_ascii=False) + "\n")
        written.append(path)
    return written
