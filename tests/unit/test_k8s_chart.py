"""The Helm chart `tangram deploy k8s` renders: `helm lint` and `helm template` pass, every manifest validates
against its schema, and what it deploys is what the topology declares.

Schemas: the Kubernetes OpenAPI schemas (kubernetes-validate, strict: no unknown fields) for the built-in
kinds; KEDA's ScaledObject and the Prometheus Operator's ServiceMonitor through pydantic models generated
from their CRDs (cloudcoil), checked to keep every field we wrote. No package ships Strimzi's KafkaTopic
CRD, so its structure is checked here field by field.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject, TriggerAuthentication
from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor
from reference import IMAGE_APP, INTAKE, PM_TOPOLOGY as TOPOLOGY
from typer.testing import CliRunner

from streams.cli import app
from streams.deploy import ChartSettings, chart_values, render_chart
from streams.errors import TangramError, TopologyError
from streams.gateway.webapp import HEALTH_PATH
from streams.gateway.processes import gateway_command, gateway_processes
from streams.monitor.dashboards import DASHBOARDS, PROCESSOR_METRICS_PORT, dashboard_json
from streams.payloads import payload_processors
from streams.security.acls import gateway_principal, principal_grants, processor_principal, strimzi_acls
from streams.topology import ComputeConstraints, load_topology

RELEASE = "pm"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRD_MODELS = {"ScaledObject": ScaledObject, "ServiceMonitor": ServiceMonitor, "TriggerAuthentication": TriggerAuthentication}
STRIMZI = ("KafkaTopic", "KafkaUser")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@pytest.fixture(scope="module")
def helm() -> str:
    found = os.environ.get("TANGRAM_HELM") or shutil.which("helm")
    if not found or not Path(found).is_file():
        pytest.fail("no helm binary: `make helm` builds it (TANGRAM_HELM names it)")
    return found


@pytest.fixture(scope="module")
def topology():
    return load_topology(TOPOLOGY)


@pytest.fixture(scope="module")
def chart(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chart") / "pm"
    result = CliRunner().invoke(app, ["deploy", "k8s", str(TOPOLOGY), "--out", str(out), "--app-path", IMAGE_APP])
    assert result.exit_code == 0, result.output
    return out


def template(helm: str, chart: Path, *sets: str) -> list[dict]:
    args = [helm, "template", RELEASE, str(chart)]
    for item in sets:
        args += ["--set", item]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def manifests(helm, chart) -> list[dict]:
    return template(helm, chart)


def by_kind(manifests: list[dict], kind: str) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def test_helm_lint_passes(helm, chart):
    done = subprocess.run([helm, "lint", "--strict", str(chart)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_against_the_kubernetes_openapi_schemas(manifests, version):
    builtin = [m for m in manifests if m["kind"] not in (*CRD_MODELS, *STRIMZI)]
    assert {m["kind"] for m in builtin} == {"Deployment", "StatefulSet", "Service", "PersistentVolumeClaim", "Job",
                                            "ConfigMap", "HorizontalPodAutoscaler"}
    for manifest in builtin:
        kubernetes_validate.validate(manifest, version, strict=True)


def test_keda_and_prometheus_operator_resources_match_their_crds(manifests):
    checked = 0
    for manifest in manifests:
        model = CRD_MODELS.get(manifest["kind"])
        if model is None:
            continue
        kept = model.model_validate(manifest).model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert kept == manifest, f"{manifest['kind']} {manifest['metadata']['name']}: a field is not in the CRD"
        checked += 1
    assert checked == sum(len(by_kind(manifests, kind)) for kind in CRD_MODELS) > 0


def test_kafka_topics_have_strimzis_structure(manifests):
    topics = by_kind(manifests, "KafkaTopic")
    assert topics
    for name, topic in topics.items():
        assert topic["apiVersion"] == "kafka.strimzi.io/v1beta2"
        assert DNS_SUBDOMAIN.match(name) and len(name) <= 253, name
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == "tangram"
        spec = topic["spec"]
        assert set(spec) == {"topicName", "partitions", "replicas", "config"}
        assert isinstance(spec["partitions"], int) and spec["partitions"] >= 1
        assert isinstance(spec["replicas"], int) and 1 <= spec["replicas"] <= 32767
        assert set(spec["config"]) <= {"cleanup.policy", "retention.ms"}
        assert all(isinstance(value, str) for value in spec["config"].values())


def test_every_principal_is_a_kafka_user_with_the_topologys_acls(manifests, topology):
    users = by_kind(manifests, "KafkaUser")
    grants = principal_grants(topology)
    assert set(users) == {*grants, "tangram-registry", "tangram-operator"}
    for name, user in users.items():
        assert user["apiVersion"] == "kafka.strimzi.io/v1beta2" and DNS_SUBDOMAIN.match(name), name
        assert user["metadata"]["labels"]["strimzi.io/cluster"] == "tangram"
        assert user["spec"]["authentication"] == {"type": "scram-sha-512"}
        acls = user["spec"].get("authorization", {}).get("acls", [])
        if name in grants:
            assert acls == strimzi_acls(grants[name])
        for acl in acls:
            assert set(acl) == {"resource", "operations"} and set(acl["operations"]) <= {"Read", "Write", "Describe", "Create"}
            assert acl["resource"]["type"] in ("topic", "group", "transactionalId")
            assert acl["resource"]["patternType"] in ("literal", "prefix")
            writes_internal = "Write" in acl["operations"] and acl["resource"]["name"].startswith(("_tangram.", "_schemas"))
            assert not writes_internal or name in ("pm.canary", "tangram-registry"), (name, acl)
    assert "authorization" not in users["tangram-operator"]["spec"]  # a super user of the cluster: no ACLs of its own


def test_processors_connect_as_their_own_principal_with_the_cluster_ca(manifests, topology):
    for name in topology.processors:
        pod = by_kind(manifests, "Deployment")[f"{RELEASE}-{name}"]["spec"]["template"]["spec"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        principal = processor_principal(topology, name)
        assert env["TANGRAM_KAFKA_SECURITY__PROTOCOL"]["value"] == "SASL_SSL"
        assert env["TANGRAM_KAFKA_SECURITY__USERNAME"]["value"] == principal
        assert env["TANGRAM_KAFKA_SECURITY__PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": principal, "key": "password"}
        assert env["TANGRAM_REGISTRY_USERNAME"]["value"] == "tangram-reader"
        assert {"name": "kafka-ca", "secret": {"secretName": "tangram-cluster-ca-cert"}} in pod["volumes"]
        assert env["TANGRAM_KAFKA_SECURITY__CA_FILE"]["value"] == "/etc/tangram/kafka-ca/ca.crt"
    job = by_kind(manifests, "Job")[f"{RELEASE}-apply"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in job["env"]}
    assert env["TANGRAM_KAFKA_SECURITY__USERNAME"]["value"] == "tangram-operator"
    assert env["TANGRAM_REGISTRY_USERNAME"]["value"] == "tangram-operator"


def test_without_kafka_security_no_users_and_plaintext(helm, chart):
    manifests = template(helm, chart, "kafka.security.enabled=false", "kafka.port=9092")
    assert not by_kind(manifests, "KafkaUser") and not by_kind(manifests, "TriggerAuthentication")
    env = {e["name"] for d in by_kind(manifests, "Deployment").values() for c in d["spec"]["template"]["spec"]["containers"]
           for e in c.get("env", [])}
    assert not any(name.startswith("TANGRAM_KAFKA_SECURITY") for name in env)


def test_round_trip_replicas_bounds_and_topics_equal_the_topology(manifests, topology):
    deployments, scaled = by_kind(manifests, "Deployment"), by_kind(manifests, "ScaledObject")
    for name, spec in topology.processors.items():
        deployment = deployments[f"{RELEASE}-{name}"]
        bound = min(topology.partitions(topic) for topic in spec.inputs)
        if name == "canary":  # decides for the whole model: one replica, never scaled
            assert deployment["spec"]["replicas"] == spec.replicas == 1
            assert f"{RELEASE}-{name}" not in scaled
            continue
        assert "replicas" not in deployment["spec"], "KEDA owns the count; an upgrade must not reset it"
        scaler = scaled[f"{RELEASE}-{name}"]["spec"]
        assert scaler["scaleTargetRef"]["name"] == f"{RELEASE}-{name}"
        assert (scaler["minReplicaCount"], scaler["maxReplicaCount"]) == (spec.replicas, bound)
        assert [t["metadata"]["topic"] for t in scaler["triggers"]] == spec.inputs
        assert {t["metadata"]["consumerGroup"] for t in scaler["triggers"]} == {topology.group(name)}
        assert {t["type"] for t in scaler["triggers"]} == {"kafka"}
    topics = {t["spec"]["topicName"]: t["spec"] for t in by_kind(manifests, "KafkaTopic").values()}
    assert topics == {
        name: {"topicName": name, "partitions": topology.partitions(name), "replicas": topology.replication(name),
               "config": topology.topic_configs(name)}
        for name in topology.topics
    }


def test_without_autoscaling_every_deployment_runs_the_declared_replicas(helm, chart, topology):
    manifests = template(helm, chart, "autoscaling.enabled=false")
    assert not by_kind(manifests, "ScaledObject")
    deployments = by_kind(manifests, "Deployment")
    for name, spec in topology.processors.items():
        assert deployments[f"{RELEASE}-{name}"]["spec"]["replicas"] == spec.replicas


def test_processors_run_the_app_and_are_probed_on_their_metrics_port(manifests, topology):
    deployments, monitors = by_kind(manifests, "Deployment"), by_kind(manifests, "ServiceMonitor")
    for name in topology.processors:
        container = deployments[f"{RELEASE}-{name}"]["spec"]["template"]["spec"]["containers"][0]
        assert container["args"] == ["run", IMAGE_APP, name, "--metrics-port", str(PROCESSOR_METRICS_PORT)]
        assert container["ports"] == [{"name": "metrics", "containerPort": PROCESSOR_METRICS_PORT}]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        requests = container["resources"]["requests"]
        assert requests["cpu"] == f"{round(topology.processors[name].compute.target_utilization * 1000)}m"
        endpoint = monitors[f"{RELEASE}-{name}"]["spec"]["endpoints"][0]
        assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")


def test_triton_serves_a_repository_the_init_container_builds_with_a_gpu_when_asked(helm, chart, manifests):
    triton = by_kind(manifests, "Deployment")[f"{RELEASE}-triton"]["spec"]["template"]["spec"]
    init = triton["initContainers"][0]
    assert init["image"] == "tangram:0.1.0"
    assert init["args"] == ["models", "build", IMAGE_APP, "--repository", "/models"]
    server = triton["containers"][0]
    assert server["image"].startswith("nvcr.io/nvidia/tritonserver:")
    assert "--model-control-mode=explicit" in server["args"] and "--model-repository=/models" in server["args"]
    claim = triton["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim in by_kind(manifests, "PersistentVolumeClaim")
    assert "nvidia.com/gpu" not in server["resources"].get("limits", {}), "the reference topology declares device any"
    gpu = template(helm, chart, "triton.gpu.enabled=true")
    limits = by_kind(gpu, "Deployment")[f"{RELEASE}-triton"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert limits["limits"]["nvidia.com/gpu"] == 1 and limits["limits"]["memory"] == "8Gi"


def test_an_inference_processor_declaring_gpu_turns_the_gpu_on(topology):
    settings = ChartSettings(app_path=IMAGE_APP)
    assert chart_values(topology, settings)["triton"]["gpu"]["enabled"] is False
    inference = topology.processors["inference"]
    on_gpu = inference.model_copy(update={"compute": ComputeConstraints(device="gpu")})
    gpu_topology = topology.model_copy(update={"processors": {**topology.processors, "inference": on_gpu}})
    assert chart_values(gpu_topology, settings)["triton"]["gpu"]["enabled"] is True


def test_secrets_are_referenced_never_written(manifests, chart):
    assert not by_kind(manifests, "Secret")
    values = yaml.safe_load((chart / "values.yaml").read_text())
    registry = values["schemaRegistry"]
    secrets = {values["redis"]["existingSecret"], registry["reader"]["secret"], registry["admin"]["secret"],
               values["gateways"]["mqtt"]["passwordSecret"]["name"],
               *values["kafka"]["users"]}  # the User Operator makes a Secret per KafkaUser
    checked = 0
    for workload in [*by_kind(manifests, "Deployment").values(), *by_kind(manifests, "StatefulSet").values(),
                     *by_kind(manifests, "Job").values()]:
        pod = workload["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            for env in container.get("env", []):
                if "PASSWORD" in env["name"]:
                    assert "value" not in env
                    assert env["valueFrom"]["secretKeyRef"]["name"] in secrets
                    checked += 1
    assert checked > len(values["processors"])


def test_apply_runs_before_an_upgrade_so_an_incompatible_schema_stops_it(manifests):
    job = by_kind(manifests, "Job")[f"{RELEASE}-apply"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["apply", IMAGE_APP, "--no-models"]


def test_processors_that_read_model_artifacts_build_them_as_triton_does(manifests, topology):
    deployments = by_kind(manifests, "Deployment")
    for name, spec in topology.processors.items():
        pod = deployments[f"{RELEASE}-{name.replace('_', '-')}"]["spec"]["template"]["spec"]
        if topology.load_object(spec.kind).needs_models:
            [init] = pod["initContainers"]
            assert init["args"] == ["models", "build", IMAGE_APP, "--repository", "/models"]
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert env["TANGRAM_MODEL_REPOSITORY"] == "/models"
        else:
            assert "initContainers" not in pod


def test_dashboards_are_the_generated_ones(manifests):
    maps = by_kind(manifests, "ConfigMap")
    for dashboard in DASHBOARDS:
        data = maps[f"{RELEASE}-{dashboard.uid}"]
        assert data["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(data["data"][f"{dashboard.uid}.json"]) == dashboard_json(dashboard)


def test_replicas_above_the_partitions_are_refused(helm, chart, topology, tmp_path):
    done = subprocess.run([helm, "template", RELEASE, str(chart), "--set", "processors.ingest.replicas=4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "processor ingest: 4 replicas, but its narrowest input has 3 partitions" in done.stderr
    ingest = topology.processors["ingest"].model_copy(update={"replicas": 4})
    crowded = topology.model_copy(update={"processors": {**topology.processors, "ingest": ingest}})
    with pytest.raises(TopologyError, match="4 replicas but its narrowest input has 3 partitions"):
        render_chart(crowded, "test", tmp_path / "chart", ChartSettings(app_path=IMAGE_APP))


def test_rendering_never_clears_a_folder_that_holds_no_chart(topology, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(TangramError, match="holds no chart"):
        render_chart(topology, "test", tmp_path, ChartSettings(app_path=IMAGE_APP))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    chart = tmp_path / "chart"
    render_chart(topology, "test", chart, ChartSettings(app_path=IMAGE_APP))
    (chart / "templates" / "stale.yaml").write_text("kind: Stale")
    render_chart(topology, "test", chart, ChartSettings(app_path=IMAGE_APP))
    assert not (chart / "templates" / "stale.yaml").exists()


def test_a_processor_left_to_flink_can_be_dropped_from_the_release(helm, chart):
    manifests = template(helm, chart, "processors.features=null")  # docs/deploy.md: the feature job on Flink
    names = {m["metadata"]["name"] for m in manifests}
    assert f"{RELEASE}-features" not in names and f"{RELEASE}-inference" in names


# -- the gateways and the payload store ------------------------------------------------------------------------

INTAKE_APP = "/app/topologies/document_intake"


@pytest.fixture(scope="module")
def intake_chart(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chart") / "intake"
    result = CliRunner().invoke(app, ["deploy", "k8s", str(INTAKE), "--out", str(out), "--app-path", INTAKE_APP])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def intake_manifests(helm, intake_chart) -> list[dict]:
    return template(helm, intake_chart)


def _pod(manifests: list[dict], name: str) -> dict:
    return by_kind(manifests, "Deployment")[name]["spec"]["template"]["spec"]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_the_intake_chart_lints_and_validates(helm, intake_chart, intake_manifests):
    done = subprocess.run([helm, "lint", "--strict", str(intake_chart)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for manifest in intake_manifests:
        if manifest["kind"] in ("Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler"):
            kubernetes_validate.validate(manifest, K8S_VERSIONS[1], strict=True)
        elif manifest["kind"] in CRD_MODELS:
            model = CRD_MODELS[manifest["kind"]]
            assert model.model_validate(manifest).model_dump(by_alias=True, exclude_unset=True, mode="json") == manifest


def test_each_gateway_process_the_topology_declares_is_a_deployment_running_its_command(manifests, intake_manifests):
    for release_manifests, path, topology in ((manifests, IMAGE_APP, load_topology(TOPOLOGY)),
                                              (intake_manifests, INTAKE_APP, load_topology(INTAKE))):
        processes = gateway_processes(topology)
        gateways = {name: d for name, d in by_kind(release_manifests, "Deployment").items() if "-gateway-" in name}
        assert set(gateways) == {f"{RELEASE}-gateway-{kind}" for kind in processes} and gateways
        for kind, streams in processes.items():
            [container] = _pod(release_manifests, f"{RELEASE}-gateway-{kind}")["containers"]
            assert container["args"] == gateway_command(kind, path, streams, metrics_port=PROCESSOR_METRICS_PORT)
            env = _env(container)
            assert env["TANGRAM_HOST"]["value"] == "0.0.0.0"
            assert "TANGRAM_REDIS_PASSWORD" not in env and "TANGRAM_TRITON_HOST" not in env  # Kafka and the registry only
    assert set(gateway_processes(load_topology(TOPOLOGY))) == {"http", "mqtt"}
    assert set(gateway_processes(load_topology(INTAKE))) == {"upload"}


def test_http_gateways_listen_on_a_service_are_probed_on_healthz_and_scale_on_cpu(manifests, intake_manifests):
    for release_manifests, kind, port in ((manifests, "http", 8088), (intake_manifests, "upload", 8089)):
        name = f"{RELEASE}-gateway-{kind}"
        deployment = by_kind(release_manifests, "Deployment")[name]
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert container["ports"] == [{"name": "http", "containerPort": port},
                                      {"name": "metrics", "containerPort": PROCESSOR_METRICS_PORT}]
        assert container["args"][container["args"].index("--port") + 1] == str(port)
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": HEALTH_PATH, "port": "http"}
        service = by_kind(release_manifests, "Service")[name]["spec"]
        assert service["selector"] == {"app.kubernetes.io/instance": RELEASE, "tangram.dev/gateway": kind}
        assert deployment["spec"]["selector"]["matchLabels"] == service["selector"]
        assert {"name": "http", "port": port, "targetPort": "http"} in service["ports"]
        assert "replicas" not in deployment["spec"], "the HPA owns the count"
        hpa = by_kind(release_manifests, "HorizontalPodAutoscaler")[name]["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert hpa["minReplicas"] == 2 and hpa["maxReplicas"] == 6
        monitor = by_kind(release_manifests, "ServiceMonitor")[name]["spec"]
        assert monitor["selector"]["matchLabels"]["tangram.dev/gateway"] == kind
        assert monitor["endpoints"][0]["port"] == "metrics"


def test_the_mqtt_adapter_is_one_replica_replaced_not_doubled_with_its_broker_password_by_reference(manifests):
    name = f"{RELEASE}-gateway-mqtt"
    deployment = by_kind(manifests, "Deployment")[name]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert name not in by_kind(manifests, "HorizontalPodAutoscaler")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = _env(container)
    assert (env["TANGRAM_MQTT_HOST"]["value"], env["TANGRAM_MQTT_PORT"]["value"]) == ("mosquitto", "1883")
    assert env["TANGRAM_MQTT_USERNAME"]["value"] == "pm.gateway"
    assert env["TANGRAM_MQTT_PASSWORD"] == {"name": "TANGRAM_MQTT_PASSWORD",
                                            "valueFrom": {"secretKeyRef": {"name": "pm-mqtt-gateway", "key": "password"}}}
    assert [p["name"] for p in container["ports"]] == ["metrics"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert [p["name"] for p in by_kind(manifests, "Service")[name]["spec"]["ports"]] == ["metrics"]


def test_gateways_connect_as_the_gateway_principal_with_the_cluster_ca(manifests, helm, chart):
    topology = load_topology(TOPOLOGY)
    principal = gateway_principal(topology)
    assert principal in by_kind(manifests, "KafkaUser")
    for kind in gateway_processes(topology):
        pod = _pod(manifests, f"{RELEASE}-gateway-{kind}")
        env = _env(pod["containers"][0])
        assert env["TANGRAM_KAFKA_SECURITY__PROTOCOL"]["value"] == "SASL_SSL"
        assert env["TANGRAM_KAFKA_SECURITY__USERNAME"]["value"] == principal
        assert env["TANGRAM_KAFKA_SECURITY__PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": principal, "key": "password"}
        assert env["TANGRAM_KAFKA_SECURITY__CA_FILE"]["value"] == "/etc/tangram/kafka-ca/ca.crt"
        assert env["TANGRAM_REGISTRY_USERNAME"]["value"] == "tangram-reader"
        assert {"name": "kafka-ca", "secret": {"secretName": "tangram-cluster-ca-cert"}} in pod["volumes"]
        assert {"name": "kafka-ca", "mountPath": "/etc/tangram/kafka-ca", "readOnly": True} in \
            pod["containers"][0]["volumeMounts"]
    plain = template(helm, chart, "kafka.security.enabled=false", "kafka.port=9092")
    for kind in gateway_processes(topology):
        pod = _pod(plain, f"{RELEASE}-gateway-{kind}")
        assert "volumes" not in pod and not any(n.startswith("TANGRAM_KAFKA_SECURITY") for n in _env(pod["containers"][0]))


def test_gateways_can_be_left_out_and_their_bounds_are_checked(helm, chart):
    names = {m["metadata"]["name"] for m in template(helm, chart, "gateways.mqtt.enabled=false")}
    assert f"{RELEASE}-gateway-mqtt" not in names and f"{RELEASE}-gateway-http" in names
    fixed = by_kind(template(helm, chart, "gateways.http.autoscaling.enabled=false"), "Deployment")
    assert fixed[f"{RELEASE}-gateway-http"]["spec"]["replicas"] == 2
    done = subprocess.run([helm, "template", RELEASE, str(chart), "--set", "gateways.http.replicas=8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "gateways.http: autoscaling.maxReplicas 6 is below replicas 8" in done.stderr


def test_one_payload_claim_mounted_by_the_upload_gateway_and_the_processors_that_read_references(intake_manifests, helm,
                                                                                                   intake_chart):
    topology = load_topology(INTAKE)
    claims = by_kind(intake_manifests, "PersistentVolumeClaim")
    claim = claims[f"{RELEASE}-payloads"]["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"] and claim["resources"]["requests"]["storage"] == "10Gi"
    readers = payload_processors(topology)
    assert readers == ["intake", "ocr"], "intake reads the uploads' references, ocr the accepted documents'"
    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    assert "ENV TANGRAM_HOME=/var/lib/tangram" in dockerfile  # where PayloadStore.of puts `payloads.store`
    mount = {"name": "payloads", "mountPath": f"/var/lib/tangram/{topology.payloads.store}"}
    volume = {"name": "payloads", "persistentVolumeClaim": {"claimName": f"{RELEASE}-payloads"}}
    mounted = set()
    for name in [f"gateway-{kind}" for kind in gateway_processes(topology)] + list(topology.processors):
        pod = _pod(intake_manifests, f"{RELEASE}-{name}")
        if volume in pod.get("volumes", []):
            assert mount in pod["containers"][0]["volumeMounts"], name
            mounted.add(name)
        else:
            assert all(m["name"] != "payloads" for m in pod["containers"][0].get("volumeMounts", [])), name
    assert mounted == {"gateway-upload", *readers}
    brought = template(helm, intake_chart, "payloads.existingClaim=shared-payloads")
    assert f"{RELEASE}-payloads" not in by_kind(brought, "PersistentVolumeClaim")
    assert {"name": "payloads", "persistentVolumeClaim": {"claimName": "shared-payloads"}} in \
        _pod(brought, f"{RELEASE}-gateway-upload")["volumes"]


def test_an_app_without_references_gets_no_payload_claim(manifests, chart):
    assert f"{RELEASE}-payloads" not in by_kind(manifests, "PersistentVolumeClaim")
    assert yaml.safe_load((chart / "values.yaml").read_text())["payloads"] is None


@pytest.mark.parametrize("kind", ["http", "upload", "mqtt"])
def test_the_gateway_commands_parse_with_the_cli(kind):
    """What the chart and compose run is a command `tangram` has: every option exists and takes its value."""
    import typer.main

    args = gateway_command(kind, INTAKE_APP, ["telemetry"], metrics_port=PROCESSOR_METRICS_PORT)
    group = typer.main.get_command(app)
    context = group.make_context("tangram", list(args), resilient_parsing=False)
    gateway = group.get_command(context, "gateway")
    sub_context = gateway.make_context("gateway", args[1:], parent=context)
    command = gateway.get_command(sub_context, kind)
    parsed = command.make_context(kind, args[2:], parent=sub_context).params
    assert str(parsed["topology"]) == INTAKE_APP and parsed["metrics_port"] == PROCESSOR_METRICS_PORT
    if kind != "mqtt":
        assert parsed["host"] == "0.0.0.0" and parsed["port"] in (8088, 8089)
    if kind != "upload":
        assert parsed["stream"] == ["telemetry"]


def test_redis_persists_by_its_append_only_file_alone(manifests):
    """As the local stack and compose: the AOF, and no RDB snapshot forking the online store every minute."""
    [redis] = [s for name, s in by_kind(manifests, "StatefulSet").items() if name.endswith("-redis")]
    [container] = redis["spec"]["template"]["spec"]["containers"]
    assert "exec redis-server --appendonly yes --save '' --requirepass" in container["command"][-1]
