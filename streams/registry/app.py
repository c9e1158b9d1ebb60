"""The Confluent Schema Registry REST API (the part clients use), served with aiohttp.

Reads answer from :class:`SchemaRegistryState`; every write is appended to the Kafka log and
acknowledged by the broker before the state changes and before the HTTP response is sent.
Deviation from Confluent, on purpose: ``GET /config/{subject}`` falls back to the global level
when the subject has none (what confluent-kafka's ``get_compatibility`` documents).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from streams.registry.auth import Authenticator, RegistryUsers, auth_middleware
from streams.registry.log import KafkaLog
from streams.registry.store import RegistryError, SchemaRegistryState, parse_version
from streams.statelog import LogRecord

log = logging.getLogger("tangram.registry")

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class Registry:
    """State plus the log it is kept in; one writer at a time."""

    def __init__(self, log_: KafkaLog | None, state: SchemaRegistryState | None = None) -> None:
        self.log = log_
        self.state = state or SchemaRegistryState()
        self._write_lock = asyncio.Lock()

    def load(self) -> int:
        """Create the topic if needed and replay it into the state; returns the record count."""
        if self.log is None:
            return 0
        self.log.ensure_topic()
        count = 0
        for record in self.log.replay():
            self.state.apply(record)
            count += 1
        return count

    async def commit(self, records: list[LogRecord]) -> None:
        """Append records to the log (acknowledged), then apply them to the state."""
        if not records:
            return
        if self.log is not None:
            await asyncio.to_thread(self.log.append, records)
        for record in records:
            self.state.apply(record)

    async def change(self, plan: Callable[[], tuple[Any, list[LogRecord]]]) -> Any:
        """Plan a change against the current state and commit it, serialized with other writes."""
        async with self._write_lock:
            result, records = plan()
            await self.commit(records)
            return result


STATE_KEY = web.AppKey("registry", Registry)


def _reply(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type=CONTENT_TYPE)


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "false").lower() == "true"


async def _schema_body(request: web.Request) -> str:
    """The ``schema`` text of a request body; only Avro (``schemaType`` AVRO or absent)."""
    try:
        body = json.loads(await request.text())
    except ValueError as exc:
        raise RegistryError(400, 400, f"Unexpected character in request body: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
        raise RegistryError(422, 42201, "Invalid schema: the request body needs a 'schema' string")
    schema_type = body.get("schemaType") or "AVRO"
    if schema_type != "AVRO":
        raise RegistryError(422, 42201, f"Invalid schema: schemaType {schema_type} is not supported, only AVRO")
    if body.get("references"):
        raise RegistryError(422, 42201, "Invalid schema: schema references are not supported")
    return body["schema"]


def _registry(request: web.Request) -> Registry:
    return request.app[STATE_KEY]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every error as Confluent's ``{"error_code": ..., "message": ...}``."""
    try:
        return await handler(request)
    except RegistryError as exc:
        return _reply({"error_code": exc.error_code, "message": exc.message}, exc.status)
    except web.HTTPException as exc:
        return _reply({"error_code": exc.status, "message": f"HTTP {exc.status} {exc.reason}"}, exc.status)
    except Exception as exc:  # the backing store failed: Confluent's 50001
        log.exception("request %s %s failed", request.method, request.path)
        return _reply({"error_code": 50001, "message": f"Error in the backend data store: {exc}"}, 500)


routes = web.RouteTableDef()


@routes.get("/")
async def root(_request: web.Request) -> web.Response:
    return _reply({})


@routes.get("/schemas/types")
async def schema_types(_request: web.Request) -> web.Response:
    return _reply(["AVRO"])


@routes.get("/schemas/ids/{id}")
async def schema_by_id(request: web.Request) -> web.Response:
    return _reply({"schema": _registry(request).state.schema_by_id(_int_id(request))})


@routes.get("/schemas/ids/{id}/schema")
async def raw_schema_by_id(request: web.Request) -> web.Response:
    return _reply(json.loads(_registry(request).state.schema_by_id(_int_id(request))))


@routes.get("/schemas/ids/{id}/versions")
async def versions_of_id(request: web.Request) -> web.Response:
    found = _registry(request).state.versions_of_id(_int_id(request), _flag(request, "deleted"))
    return _reply([{"subject": sv.subject, "version": sv.version} for sv in found])


@routes.get("/schemas/ids/{id}/subjects")
async def subjects_of_id(request: web.Request) -> web.Response:
    found = _registry(request).state.versions_of_id(_int_id(request), _flag(request, "deleted"))
    return _reply(sorted({sv.subject for sv in found}))


@routes.get("/subjects")
async def subjects(request: web.Request) -> web.Response:
    state = _registry(request).state
    prefix = request.query.get("subjectPrefix", "")
    names = state.subject_names(_flag(request, "deleted") or _flag(request, "deleted_only"), prefix)
    if _flag(request, "deleted_only"):
        live = set(state.subject_names(False, prefix))
        names = [n for n in names if n not in live]
    return _reply(names)


@routes.get("/subjects/{subject}/versions")
async def subject_versions(request: web.Request) -> web.Response:
    found = _registry(request).state.versions(request.match_info["subject"], _flag(request, "deleted"))
    return _reply([sv.version for sv in found])


@routes.post("/subjects/{subject}/versions")
async def register(request: web.Request) -> web.Response:
    subject, schema = request.match_info["subject"], await _schema_body(request)
    registry = _registry(request)
    sv = await registry.change(lambda: registry.state.register(subject, schema))
    log.info("subject %s version %d has id %d", subject, sv.version, sv.id)
    return _reply({"id": sv.id, "version": sv.version, "subject": subject})


@routes.post("/subjects/{subject}")
async def lookup(request: web.Request) -> web.Response:
    subject, schema = request.match_info["subject"], await _schema_body(request)
    sv = _registry(request).state.lookup(subject, schema, _flag(request, "deleted"))
    return _reply(sv.to_response())


@routes.get("/subjects/{subject}/versions/{version}")
async def get_version(request: web.Request) -> web.Response:
    sv = _registry(request).state.get_version(
        request.match_info["subject"], request.match_info["version"], _flag(request, "deleted")
    )
    return _reply(sv.to_response())


@routes.get("/subjects/{subject}/versions/{version}/schema")
async def get_version_schema(request: web.Request) -> web.Response:
    sv = _registry(request).state.get_version(
        request.match_info["subject"], request.match_info["version"], _flag(request, "deleted")
    )
    return _reply(json.loads(sv.schema))


@routes.delete("/subjects/{subject}")
async def delete_subject(request: web.Request) -> web.Response:
    subject, permanent = request.match_info["subject"], _flag(request, "permanent")
    registry = _registry(request)
    versions = await registry.change(lambda: registry.state.delete_subject(subject, permanent))
    log.info("subject %s deleted (permanent=%s): versions %s", subject, permanent, versions)
    return _reply(versions)


@routes.delete("/subjects/{subject}/versions/{version}")
async def delete_version(request: web.Request) -> web.Response:
    subject, version = request.match_info["subject"], request.match_info["version"]
    permanent = _flag(request, "permanent")
    registry = _registry(request)
    deleted = await registry.change(lambda: registry.state.delete_version(subject, version, permanent))
    log.info("subject %s version %d deleted (permanent=%s)", subject, deleted, permanent)
    return _reply(deleted)


@routes.get("/config")
async def get_global_config(request: web.Request) -> web.Response:
    return _reply({"compatibilityLevel": _registry(request).state.level()})


@routes.get("/config/{subject}")
async def get_subject_config(request: web.Request) -> web.Response:
    return _reply({"compatibilityLevel": _registry(request).state.level(request.match_info["subject"])})


@routes.put("/config")
@routes.put("/config/{subject}")
async def put_config(request: web.Request) -> web.Response:
    subject = request.match_info.get("subject")
    try:
        body = json.loads(await request.text())
    except ValueError as exc:
        raise RegistryError(400, 400, f"Unexpected character in request body: {exc}") from exc
    wanted = body.get("compatibility", body.get("compatibilityLevel")) if isinstance(body, dict) else None
    registry = _registry(request)
    level = await registry.change(lambda: registry.state.set_level(subject, wanted))
    log.info("compatibility of %s set to %s", subject or "(global)", level)
    return _reply({"compatibility": level})


@routes.delete("/config")
@routes.delete("/config/{subject}")
async def delete_config(request: web.Request) -> web.Response:
    subject = request.match_info.get("subject")
    registry = _registry(request)
    previous = await registry.change(lambda: registry.state.delete_level(subject))
    return _reply({"compatibilityLevel": previous})


@routes.get("/mode")
@routes.get("/mode/{subject}")
async def get_mode(_request: web.Request) -> web.Response:
    return _reply({"mode": "READWRITE"})


@routes.post("/compatibility/subjects/{subject}/versions/{version}")
@routes.post("/compatibility/subjects/{subject}/versions")
async def test_compatibility(request: web.Request) -> web.Response:
    subject, schema = request.match_info["subject"], await _schema_body(request)
    version = request.match_info.get("version")
    state = _registry(request).state
    if version is not None:
        parse_version(version)
        if version in ("latest", "-1") and subject not in state.subject_names():
            messages: list[str] = []  # nothing registered yet: anything is compatible, like Confluent
        else:
            messages = state.incompatibilities(subject, schema, version)
    else:
        messages = state.incompatibilities(subject, schema)
    body: dict[str, Any] = {"is_compatible": not messages}
    if _flag(request, "verbose"):
        body["messages"] = messages
    return _reply(body)


def _int_id(request: web.Request) -> int:
    try:
        return int(request.match_info["id"])
    except ValueError:
        raise RegistryError(404, 40403, f"Schema {request.match_info['id']} not found") from None


def create_app(registry: Registry, users: RegistryUsers | None = None) -> web.Application:
    """The aiohttp application serving ``registry``; with ``users``, behind basic auth (``streams.registry.auth``)."""
    middlewares = [auth_middleware(Authenticator(users))] if users is not None else []
    app = web.Application(middlewares=[*middlewares, errors_middleware])
    app[STATE_KEY] = registry
    app.add_routes(routes)
    return app
