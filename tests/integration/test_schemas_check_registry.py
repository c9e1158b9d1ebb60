"""An incompatible contract change is refused: by `tangram schemas check --registry` before deploy, and by the registry."""

from __future__ import annotations

import json
import uuid

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from typer.testing import CliRunner

from reference import PM
from streams.cli import app
from streams.schemas_check import RegistryHistory, check_schemas

pytestmark = pytest.mark.integration

V1 = {"type": "record", "name": "Reading", "namespace": "t", "fields": [
    {"name": "id", "type": "string"}, {"name": "temp", "type": "double"}]}


def test_incompatible_change_is_refused_before_deploy_and_by_the_registry(stack, tmp_path):
    subject = f"c{uuid.uuid4().hex[:8]}-value"
    client = SchemaRegistryClient({"url": stack.registry_url})
    client.register_schema(subject, Schema(json.dumps(V1), "AVRO"))
    schemas = tmp_path / "avro"
    schemas.mkdir()
    (schemas / f"{subject}.avsc").write_text(json.dumps(V1))

    (report,) = check_schemas(RegistryHistory(stack.registry_url), schemas)
    assert report.ok and "before the latest" in report.compared_with  # same as registered

    broken = {**V1, "fields": [*V1["fields"], {"name": "site", "type": "string"}]}  # new field, no default
    (schemas / f"{subject}.avsc").write_text(json.dumps(broken))
    (report,) = check_schemas(RegistryHistory(stack.registry_url), schemas)
    assert report.problems == [f"{subject}: Reading.site: READER_FIELD_MISSING_DEFAULT_VALUE: reader field has no default "
                               "value and the writer does not have it (new schema cannot read data written with an "
                               "earlier one)"]
    with pytest.raises(SchemaRegistryError) as info:  # the registry agrees, under the same default level
        client.register_schema(subject, Schema(json.dumps(broken), "AVRO"))
    assert info.value.http_status_code == 409


def test_cli_checks_the_project_schemas_against_the_stack_registry(stack):
    result = CliRunner().invoke(app, ["schemas", "check", str(PM), "--registry", stack.registry_url],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "pm.ingest.telemetry-value" in result.output and "FULL_TRANSITIVE" in result.output
