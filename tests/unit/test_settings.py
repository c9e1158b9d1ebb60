"""Stack settings: what the processors are told by the environment docker-compose and Kubernetes give them."""

import redis

from streams.settings import StackSettings


def test_redis_password_from_the_environment_reaches_the_client_and_not_the_logs(monkeypatch):
    monkeypatch.setenv("TANGRAM_REDIS_HOST", "redis")
    monkeypatch.setenv("TANGRAM_REDIS_PASSWORD", "s3cr/t@:x")
    settings = StackSettings()
    pool = redis.Redis.from_url(settings.redis_url).connection_pool
    assert pool.connection_kwargs["password"] == "s3cr/t@:x"  # percent-encoded in the URL, decoded by redis-py
    assert pool.connection_kwargs["host"] == "redis"
    assert "s3cr" not in repr(settings)


def test_local_stack_redis_has_no_password(monkeypatch):
    monkeypatch.delenv("TANGRAM_REDIS_PASSWORD", raising=False)
    assert StackSettings().redis_url.startswith("redis://127.0.0.1:")


def _properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_a_three_node_stack_lists_every_broker_and_each_node_has_its_own_ports_and_storage(tmp_path):
    from streams.stack import components, kafka

    settings = StackSettings(home=tmp_path, kafka_port=29092, kafka_controller_port=29093, kafka_brokers=3)
    assert settings.bootstrap_servers == "127.0.0.1:29092,127.0.0.1:29094,127.0.0.1:29096"
    nodes = [_properties(kafka.server_properties(settings, n)) for n in (1, 2, 3)]
    assert [n["node.id"] for n in nodes] == ["1", "2", "3"]
    assert {n["controller.quorum.voters"] for n in nodes} == {"1@127.0.0.1:29093,2@127.0.0.1:29095,3@127.0.0.1:29097"}
    assert [n["advertised.listeners"] for n in nodes] == [f"PLAINTEXT://127.0.0.1:{p}" for p in (29092, 29094, 29096)]
    assert len({n["log.dirs"] for n in nodes}) == 3
    # one node of three may go down: Kafka's own topics and topics made without a factor keep 3 replicas, 2 in sync
    for n in nodes:
        assert (n["default.replication.factor"], n["offsets.topic.replication.factor"],
                n["transaction.state.log.replication.factor"], n["transaction.state.log.min.isr"]) == ("3", "3", "3", "2")
    procs = [p for p in components.build(settings) if p.component == "kafka"]
    assert [p.name for p in procs] == ["kafka", "kafka-2", "kafka-3"]
    assert len({p.pid_path for p in procs} | {p.log_path for p in procs}) == 6
    assert len({p.marker for p in procs}) == 3


def test_the_one_node_stack_keeps_its_ports_files_and_single_replicas(tmp_path):
    from streams.stack import kafka

    settings = StackSettings(home=tmp_path, kafka_port=9092, kafka_controller_port=9093, kafka_brokers=1)  # not the env's
    node = _properties(kafka.server_properties(settings))
    assert settings.bootstrap_servers == "127.0.0.1:9092"
    assert node["controller.quorum.voters"] == "1@127.0.0.1:9093"
    assert node["log.dirs"] == str(tmp_path / "kafka" / "data")
    assert kafka.properties_path(settings) == tmp_path / "kafka" / "config" / "server.properties"
    assert (node["default.replication.factor"], node["transaction.state.log.min.isr"]) == ("1", "1")


def test_each_kafka_node_keeps_its_temporary_files_in_the_home(tmp_path):
    """The native libraries a broker's JVM extracts go to the node's own folder in the home (emptied at each start),
    not to the system's /tmp, where every node killed with -9 would leave its copies for good."""
    from streams.stack import kafka

    settings = StackSettings(home=tmp_path, kafka_port=29092, kafka_controller_port=29093, kafka_brokers=3)
    folders = [arg for node in (1, 2, 3) for arg in kafka.argv(settings, node) if arg.startswith("-Djava.io.tmpdir=")]
    assert folders == [f"-Djava.io.tmpdir={tmp_path / 'kafka' / name}" for name in ("tmp", "tmp-2", "tmp-3")]


def test_node_ports_that_would_overlap_are_refused():
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError, match="overlapping ports"):
        StackSettings(kafka_port=9092, kafka_controller_port=9094, kafka_brokers=2)


def test_a_home_formatted_for_one_node_is_not_started_as_three(tmp_path):
    import pytest

    from streams.errors import StackError
    from streams.stack import kafka

    data = tmp_path / "kafka" / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text("node.id=1\n")  # formatted by a one-node stack
    settings = StackSettings(home=tmp_path, kafka_brokers=3, secure=False)
    with pytest.raises(StackError, match="formatted for 1 node"):
        kafka.prepare(settings, 1)


def test_the_secured_stack_runs_one_node(tmp_path):
    import pytest

    from streams.errors import StackError
    from streams.stack import kafka

    with pytest.raises(StackError, match="secured local stack runs one Kafka node"):
        kafka.prepare(StackSettings(home=tmp_path, kafka_brokers=3, secure=True), 1)


def test_down_and_status_see_every_node_of_a_three_node_home_without_being_told(tmp_path):
    from streams.stack import components, kafka

    three = StackSettings(home=tmp_path, kafka_brokers=3)
    kafka.data_dir(three).mkdir(parents=True)
    (kafka.data_dir(three) / "meta.properties").write_text("node.id=1\n")
    (tmp_path / "kafka" / "cluster.id").write_text("abc\n3\n")
    plain = StackSettings(home=tmp_path, kafka_brokers=1)  # as without TANGRAM_KAFKA_BROKERS
    assert kafka.node_count(plain) == 3
    assert [p.name for p in components.build(plain) if p.component == "kafka"] == ["kafka", "kafka-2", "kafka-3"]


def test_the_stack_redis_persists_by_its_append_only_file_alone(tmp_path):
    """AOF on, RDB snapshots off: a snapshot would fork and rewrite the whole online store beside the AOF."""
    from streams.stack import components

    [redis_server] = [p for p in components.build(StackSettings(home=tmp_path)) if p.component == "redis"]
    argv = redis_server.argv()
    options = dict(zip(argv[1::2], argv[2::2]))
    assert options["--appendonly"] == "yes" and options["--save"] == ""


def test_a_triton_started_by_another_installation_is_still_this_stacks_to_stop(tmp_path):
    """A stack brought up from one checkout (or wheel) and taken down from another: the pid file's Triton is
    recognised by the script's package-relative name, stopped, and not left running with its pid file gone."""
    import subprocess
    import sys

    from streams.stack import components

    [triton] = [p for p in components.build(StackSettings(home=tmp_path)) if p.component == "triton"]
    other = tmp_path / "elsewhere" / "inference_workers" / "triton_server.py"  # another installation's script
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(other)], start_new_session=True)
    try:
        triton.pid_path.parent.mkdir(parents=True, exist_ok=True)
        triton.pid_path.write_text(f"{proc.pid}\n")
        assert triton.pid() == proc.pid
        assert triton.stop()
        assert proc.wait(timeout=10) is not None and not triton.pid_path.exists()
    finally:
        proc.kill()
        proc.wait()

    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:  # a pid file naming some other program (a recycled pid) is stale, and that program is left alone
        triton.pid_path.write_text(f"{unrelated.pid}\n")
        assert triton.pid() is None and not triton.pid_path.exists()
        assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()
