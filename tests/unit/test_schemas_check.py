"""`tangram schemas check` against git history: levels per subject, messages naming field and rule."""

import json
import subprocess

import pytest
import yaml

from reference import PM, REPO, SCHEMAS
from streams.errors import SchemaError
from streams.schemas_check import GitHistory, check_schemas, load_levels
from streams.topology import Topology, load_topology

V1 = {"type": "record", "name": "Reading", "namespace": "t", "fields": [
    {"name": "id", "type": "string"}, {"name": "temp", "type": "int"}]}


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path):
    schemas = tmp_path / "schemas"
    schemas.mkdir()
    git(tmp_path, "init", "-q")
    (schemas / "r-value.avsc").write_text(json.dumps(V1))
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "v1")
    return tmp_path


def check(repo):
    return check_schemas(GitHistory(repo), repo / "schemas")


def write(repo, schema, levels=None):
    (repo / "schemas" / "r-value.avsc").write_text(json.dumps(schema))
    if levels is not None:
        (repo / "schemas" / "compatibility.yaml").write_text(yaml.safe_dump(levels))


def test_unchanged_and_compatible_changes_pass(repo):
    assert check(repo)[0].ok
    write(repo, {**V1, "fields": [*V1["fields"], {"name": "site", "type": "string", "default": ""}]})
    (report,) = check(repo)
    assert report.ok and report.level == "BACKWARD" and "1 earlier git version" in report.compared_with
    write(repo, {**V1, "fields": [V1["fields"][0], {"name": "temp", "type": "long"}]})  # int → long promotion
    assert check(repo)[0].ok


def test_field_added_without_default_breaks_backward_naming_field_and_rule(repo):
    write(repo, {**V1, "fields": [*V1["fields"], {"name": "site", "type": "string"}]})
    (report,) = check(repo)
    assert not report.ok
    assert "r-value: Reading.site: READER_FIELD_MISSING_DEFAULT_VALUE" in report.problems[0]


def test_levels_per_subject(repo):
    removed = {**V1, "fields": [V1["fields"][0]]}  # removing a field without default: BACKWARD ok, FORWARD not
    write(repo, removed)
    assert check(repo)[0].ok
    write(repo, removed, {"subjects": {"r-value": "FORWARD"}})
    (report,) = check(repo)
    assert report.level == "FORWARD" and "Reading.temp: READER_FIELD_MISSING_DEFAULT_VALUE" in report.problems[0]
    write(repo, {**V1, "fields": [V1["fields"][0], {"name": "temp", "type": "string"}]}, {"default": "NONE"})
    assert check(repo)[0].ok


def test_a_committed_incompatible_change_still_fails(repo):
    write(repo, {**V1, "fields": [V1["fields"][0], {"name": "temp", "type": "string"}]})
    git(repo, "commit", "-qam", "v2 breaks")
    (report,) = check(repo)
    assert "Reading.temp: TYPE_MISMATCH" in report.problems[0]


def test_transitive_checks_every_earlier_version(repo):
    write(repo, {**V1, "fields": [V1["fields"][0]]})  # v2 drops `temp`
    git(repo, "commit", "-qam", "v2")
    v3 = {**V1, "fields": [V1["fields"][0], {"name": "temp", "type": "string", "default": ""}]}  # back, as a string
    write(repo, v3)
    assert check(repo)[0].ok  # BACKWARD: reads v2, which has no `temp`
    write(repo, v3, {"default": "BACKWARD_TRANSITIVE"})
    (report,) = check(repo)
    assert "Reading.temp: TYPE_MISMATCH: reader type string cannot read writer type int" in report.problems[0]  # v1


def test_invalid_schema_and_bad_levels_are_named(repo):
    (repo / "schemas" / "r-value.avsc").write_text('{"type": "record", "name": "R"}')
    assert "not a valid Avro schema" in check(repo)[0].problems[0]
    (repo / "schemas" / "compatibility.yaml").write_text("default: SIDEWAYS\n")
    with pytest.raises(SchemaError, match="SIDEWAYS"):
        load_levels(repo / "schemas")
    (repo / "schemas" / "compatibility.yaml").write_text("subjects: {nope-value: FULL}\n")
    with pytest.raises(SchemaError, match="nope-value"):
        load_levels(repo / "schemas")


def test_outside_git_the_error_says_what_to_do(tmp_path):
    with pytest.raises(SchemaError, match="--registry"):
        GitHistory(tmp_path)


def test_project_schemas_pass_and_levels_load():
    assert all(r.ok for r in check_schemas(GitHistory(REPO), SCHEMAS)), \
        "tangram schemas check fails on the project's own schemas"


def test_gateways_round_trip_and_are_checked(tmp_path):
    topology = load_topology(PM)
    assert topology.gateways["telemetry"].processor == "ingest"
    assert Topology.model_validate(yaml.safe_load(topology.to_yaml())) == topology
    doc = yaml.safe_load(topology.to_yaml())
    doc["gateways"]["telemetry"]["processor"] = "features_typo"
    with pytest.raises(Exception, match="features_typo"):
        Topology.model_validate(doc)
