"""Kafka of the local stack: jars from Maven Central, KRaft configuration, storage format.

The broker is Apache Kafka 4.x from Maven Central (``streams/stack/maven/kafka-pom.xml``), run in KRaft
combined mode (each node broker and controller) with ``java -cp '<home>/kafka/libs/*' kafka.Kafka
server.properties``. One node by default; ``kafka_brokers`` (``TANGRAM_KAFKA_BROKERS=3``) runs that many,
each with its own ports, configuration and storage, formatted with one cluster id. Replication factors of
Kafka's own topics and the default of new topics follow the node count (3 at most), so a three-node stack
keeps serving with one node down.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from streams.errors import StackError
from streams.security.pki import ensure_server_cert
from streams.settings import OPERATOR, StackSettings

log = logging.getLogger("tangram.stack")

#: Package data, copied next to the jars before Maven runs (Maven writes ``target/`` beside its pom).
POM = Path(__file__).with_name("maven") / "kafka-pom.xml"
JVM_OPTS = [
    "-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
    "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
]
_STAMP = ".pom.sha256"
_SECURED_STAMP = ".tangram-secured"
#: The secured node's own principals: the broker (SCRAM, inter-broker) and the controller (PLAIN).
BROKER = "tangram-broker"
CONTROLLER = "tangram-controller"

LOG4J2 = """\
status = warn
shutdownHook = disable
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
"""


def libs_dir(settings: StackSettings) -> Path:
    return settings.home / "kafka" / "libs"


def config_dir(settings: StackSettings) -> Path:
    return settings.home / "kafka" / "config"


def properties_path(settings: StackSettings, node: int = 1) -> Path:
    """Node ``node``'s configuration (node 1's keeps the single-node stack's name)."""
    return config_dir(settings) / ("server.properties" if node == 1 else f"server-{node}.properties")


def tmp_dir(settings: StackSettings, node: int = 1) -> Path:
    """Node ``node``'s ``java.io.tmpdir``: the native libraries its JVM extracts (lz4, zstd, snappy) stay in the
    home, not in the system's ``/tmp``, where a node killed with -9 would leave them for good; emptied at each
    start."""
    return settings.home / "kafka" / ("tmp" if node == 1 else f"tmp-{node}")


def data_dir(settings: StackSettings, node: int = 1) -> Path:
    """Node ``node``'s log directory (node 1's keeps the single-node stack's name)."""
    return settings.home / "kafka" / ("data" if node == 1 else f"data-{node}")


#: The most free space a filesystem may have for ``disk-full`` faults to fill it (the machine's own disk has more).
DISK_FAULT_MAX_FREE = 2 << 30


def kafka_disk(settings: StackSettings) -> Path:
    """The mount point of the filesystem that holds node 1's log directory, when that filesystem is the log
    directory's own (mounted at it or at a folder above it inside ``TANGRAM_HOME``) and small enough to fill
    (at most 2 GiB free); otherwise a StackError saying how to give it one."""
    data = data_dir(settings)
    mount = data
    while not os.path.ismount(mount) and mount != settings.home and mount.parent != mount:
        mount = mount.parent
    how = (f"mount a small filesystem of its own there before `tangram up`, e.g. "
           f"`mkdir -p {data} && mount -t tmpfs -o size=512m tmpfs {data}` (as root)")
    if not os.path.ismount(mount):
        raise StackError(f"a disk-full fault needs Kafka's log directory {data} on a filesystem of its own: {how}")
    free = shutil.disk_usage(mount).free
    if free > DISK_FAULT_MAX_FREE:
        raise StackError(f"a disk-full fault fills the filesystem under Kafka's log directory ({mount}, "
                         f"{free / (1 << 30):.1f} GiB free): give the log directory a smaller one: {how}")
    return mount


def java() -> str:
    """The ``java`` executable, or a StackError saying how to install it."""
    exe = shutil.which("java")
    if exe is None:
        raise StackError("Java 17+ is required to run Kafka: install it (apt-get install openjdk-17-jre-headless)")
    return exe


def _pom_digest() -> str:
    return hashlib.sha256(POM.read_bytes()).hexdigest()


def jars_current(settings: StackSettings) -> bool:
    """True when the jars in ``<home>/kafka/libs`` were resolved from the current pom."""
    stamp = libs_dir(settings) / _STAMP
    return stamp.is_file() and stamp.read_text().strip() == _pom_digest()


def fetch_jars(settings: StackSettings) -> Path:
    """Resolve Kafka and its runtime dependencies with Maven into ``<home>/kafka/libs``.

    Skipped when the jars there come from the same pom. Maven caches in ``~/.m2``, so a
    second resolution (e.g. for another TANGRAM_HOME) is fast and works offline.
    """
    libs = libs_dir(settings)
    if jars_current(settings):
        log.info("kafka jars are up to date in %s", libs)
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven is required to fetch the Kafka jars: install it (apt-get install maven)")
    staging = libs.with_name("libs.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    log.info("resolving kafka jars from %s with maven into %s", POM, libs)
    pom = libs.parent / "pom.xml"
    pom.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(POM, pom)
    cmd = [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
           "-DincludeScope=runtime", f"-DoutputDirectory={staging}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        shutil.rmtree(staging, ignore_errors=True)
        raise StackError(f"maven could not resolve the kafka jars ({' '.join(cmd)}):\n"
                         f"{(result.stdout + result.stderr)[-3000:]}")
    (staging / _STAMP).write_text(_pom_digest() + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    log.info("kafka jars ready: %d jars in %s", len(list(libs.glob("*.jar"))), libs)
    return libs


def server_properties(settings: StackSettings, node: int = 1) -> str:
    """The KRaft combined-mode configuration of local node ``node`` (secured when ``settings.secure``).

    Kafka's own topics (offsets, transactions, share state) and topics created without a replication
    factor (``-1``: the config center, the model registry, ``_schemas``) get min(3, nodes) replicas, and
    min(2, nodes) in sync for a transaction to commit: one node of three may go down.
    """
    h, nodes = settings.host, settings.kafka_brokers
    voters = ",".join(f"{n}@{h}:{settings.kafka_node_ports(n)[1]}" for n in range(1, nodes + 1))
    replicas, min_isr = min(3, nodes), min(2, nodes)
    return "\n".join([
        "process.roles=broker,controller",
        f"node.id={node}",
        f"controller.quorum.voters={voters}",
        *(_secured_listeners(settings) if settings.secure else _plain_listeners(settings, node)),
        f"log.dirs={data_dir(settings, node)}",
        "num.partitions=1",
        "auto.create.topics.enable=false",
        f"default.replication.factor={replicas}",
        f"offsets.topic.replication.factor={replicas}",
        "offsets.topic.num.partitions=10",
        f"transaction.state.log.replication.factor={replicas}",
        f"transaction.state.log.min.isr={min_isr}",
        "transaction.state.log.num.partitions=10",
        f"share.coordinator.state.topic.replication.factor={replicas}",
        f"share.coordinator.state.topic.min.isr={min_isr}",
        "group.initial.rebalance.delay.ms=0",
        "num.network.threads=2",
        "num.io.threads=4",
        "log.retention.hours=168",
        "",
    ])


def _plain_listeners(settings: StackSettings, node: int = 1) -> list[str]:
    h = settings.host
    broker, controller = settings.kafka_node_ports(node)
    return [
        f"listeners=PLAINTEXT://{h}:{broker},CONTROLLER://{h}:{controller}",
        f"advertised.listeners=PLAINTEXT://{h}:{broker}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    ]


def _jaas(module: str, **options: str) -> str:
    pairs = " ".join(f'{k}="{v}"' for k, v in options.items())
    return f"{module} required {pairs};"


def _secured_listeners(settings: StackSettings) -> list[str]:
    """SASL_SSL everywhere: clients and the broker itself with SCRAM-SHA-512, the controller with PLAIN.

    The controller cannot authenticate with SCRAM (its credentials live in the metadata the
    controller serves), so its listener takes one PLAIN user, the node itself. Every request is
    authorized by the StandardAuthorizer; no ACL means no access. Super users: the node and the
    operator; everyone else gets the ACLs `tangram apply` generates from the topology.
    """
    h, secrets = settings.host, settings.secrets
    broker, controller = secrets.get("kafka", BROKER).get_secret_value(), secrets.get("kafka", CONTROLLER).get_secret_value()
    keystore = ensure_server_cert(settings.secrets_dir, "kafka", _cert_hosts(settings))
    plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
    return [
        f"listeners=SASL_SSL://{h}:{settings.kafka_port},CONTROLLER://{h}:{settings.kafka_controller_port}",
        f"advertised.listeners=SASL_SSL://{h}:{settings.kafka_port}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=SASL_SSL",
        "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SASL_SSL",
        "sasl.enabled.mechanisms=SCRAM-SHA-512",
        "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
        "sasl.mechanism.controller.protocol=PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
        "listener.name.controller.plain.sasl.jaas.config="
        + _jaas(plain, username=CONTROLLER, password=controller, **{f"user_{CONTROLLER}": controller}),
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=" + _jaas(scram, username=BROKER, password=broker),
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={keystore}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={settings.ca_file}",
        "ssl.client.auth=none",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found=false",
        f"super.users=User:{BROKER};User:{CONTROLLER};User:{OPERATOR}",
    ]


def _cert_hosts(settings: StackSettings) -> list[str]:
    """The names the broker's certificate must carry: where clients dial it."""
    return list(dict.fromkeys([settings.kafka_host or settings.host, settings.host, "localhost"]))


def _cluster_id() -> str:
    """A random Kafka cluster id: 16 bytes, URL-safe base64 without padding.

    Like Kafka's ``Uuid.randomUuid`` it never starts with '-', which a command line would
    take for an option.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def prepare(settings: StackSettings, node: int = 1) -> None:
    """Check java and the jars, write node ``node``'s configuration, format its storage on first start."""
    exe = java()
    if settings.secure and settings.kafka_brokers > 1:
        raise StackError(f"the secured local stack runs one Kafka node, not {settings.kafka_brokers}: "
                         "unset TANGRAM_KAFKA_BROKERS or TANGRAM_SECURE")
    if not jars_current(settings):
        fetch_jars(settings)
    config_dir(settings).mkdir(parents=True, exist_ok=True)
    properties = properties_path(settings, node)
    properties.touch(mode=0o600)  # a secured node's file holds its passwords
    properties.chmod(0o600)
    properties.write_text(server_properties(settings, node))
    (config_dir(settings) / "log4j2.properties").write_text(LOG4J2)
    shutil.rmtree(tmp_dir(settings, node), ignore_errors=True)
    tmp_dir(settings, node).mkdir(parents=True)
    data = data_dir(settings, node)
    stamp = data / _SECURED_STAMP
    if (data / "meta.properties").exists():
        if settings.secure and not stamp.exists():
            raise StackError(f"the Kafka storage in {data} was formatted without security, so it holds "
                             "no SCRAM credentials: run the secured stack from another TANGRAM_HOME")
        formatted = _formatted_nodes(settings)
        if formatted != settings.kafka_brokers:
            raise StackError(f"the Kafka storage in {settings.home / 'kafka'} was formatted for {formatted} node(s), "
                             f"not {settings.kafka_brokers}: run a {settings.kafka_brokers}-node stack from another "
                             "TANGRAM_HOME")
        return
    cluster_id = _shared_cluster_id(settings)
    log.info("kafka: formatting node %d's storage in %s (cluster id %s)", node, data, cluster_id)
    cmd = [exe, *_jvm_common(settings), "kafka.tools.StorageTool", "format", "--ignore-formatted",
           f"--cluster-id={cluster_id}", "--config", str(properties)]
    if settings.secure:  # the node's and the operator's SCRAM credentials, in the metadata from the start
        for user in (BROKER, OPERATOR):
            cmd += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={settings.secrets.get('kafka', user).get_secret_value()}]"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"kafka storage format failed:\n{(result.stdout + result.stderr)[-3000:]}")
    if settings.secure:
        stamp.write_text("SCRAM-SHA-512 credentials of the node and the operator added at format\n")


def _shared_cluster_id(settings: StackSettings) -> str:
    """The cluster id every node of this home is formatted with (made by the first node's format)."""
    path = settings.home / "kafka" / "cluster.id"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{_cluster_id()}\n{settings.kafka_brokers}\n")
    return path.read_text().split()[0]


def node_count(settings: StackSettings) -> int:
    """The nodes of this home's Kafka: as its storage was formatted, else as the settings ask.

    So ``tangram down`` and ``status`` see every node of a three-node home even without
    ``TANGRAM_KAFKA_BROKERS`` (which every client still needs, to know all the brokers).
    """
    return _formatted_nodes(settings) if (data_dir(settings) / "meta.properties").exists() else settings.kafka_brokers


def _formatted_nodes(settings: StackSettings) -> int:
    """How many nodes this home's Kafka was formatted for (a home from before multi-node stacks: 1)."""
    path = settings.home / "kafka" / "cluster.id"
    fields = path.read_text().split() if path.is_file() else []
    return int(fields[1]) if len(fields) > 1 else 1


def _jvm_common(settings: StackSettings) -> list[str]:
    return [
        "-Xmx256m",
        f"-Dlog4j2.configurationFile={config_dir(settings) / 'log4j2.properties'}",
        "-cp", f"{libs_dir(settings)}/*",
    ]


def argv(settings: StackSettings, node: int = 1) -> list[str]:
    """Node ``node``'s command line."""
    return [
        java(), *JVM_OPTS, f"-Djava.io.tmpdir={tmp_dir(settings, node)}",
        f"-Dlog4j2.configurationFile={config_dir(settings) / 'log4j2.properties'}",
        "-cp", f"{libs_dir(settings)}/*",
        "kafka.Kafka", str(properties_path(settings, node)),
    ]
