"""Sinks the runtime ships: a topic's way out of Kafka, through the declared seam (:class:`streams.stage.Sink`).

``WebhookSink`` POSTs each micro-batch of an action topic to an HTTP endpoint as one JSON document::

    notify:
      kind: streams.sinks:WebhookSink
      inputs: [pm.actions.maintenance]
      dlq: pm.dlq.notify
      params: {url: "https://ops.example.com/hooks/maintenance", timeout_s: 5.0,
               headers_from_env: {Authorization: OPS_HOOK_TOKEN}}

The body is ``{"records": [...]}``, each record the decoded value with its ``event_id`` (subscribers
deduplicate by it: a batch is sent again after a crash or an outage). A 2xx answer commits the batch;
a 4xx (the endpoint refuses these records, sending them again would not help) dead-letters every
record of the batch with the status and the start of the body; anything else — a 5xx, a timeout, a
refused connection — is an outage: the POST goes through the processor's ``http`` guard
(:mod:`streams.resilience`: the declared deadline, retries with jittered backoff, circuit breaker),
and when it gives up the loop backs off and sends the batch again, nothing is lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from streams.context import BuildContext
from streams.delivery import Record
from streams.errors import TopologyError
from streams.resilience import DEFAULT_CALLS, Guard
from streams.stage import Sink, StageSettings
from streams.topology import ExternalCall


class WebhookError(Exception):
    """The endpoint answered that it will not take these records."""


class WebhookUnavailable(Exception):
    """The endpoint did not answer, or failed (5xx): the service's fault, tried again."""


class WebhookSettings(StageSettings):
    url: str = Field(pattern=r"^https?://", description="Where each batch is POSTed.")
    timeout_s: float = Field(5.0, gt=0, le=60, description="Deadline of one POST (connect and answer).")
    headers_from_env: dict[str, str] = Field(
        default_factory=dict, description="Header → the environment variable holding its value (secrets by reference).")


class WebhookSink(Sink):
    """Micro-batches → one JSON POST each; commit after a 2xx (see the module's doc)."""

    Settings = WebhookSettings
    services = frozenset({"http", "registry"})
    settings: WebhookSettings

    def __init__(self, ctx: BuildContext):
        super().__init__(ctx)
        self.guard = ctx.calls.guard("http", (WebhookUnavailable,))
        if "http" not in ctx.calls.declared:  # the sink's own timeout_s is the deadline then
            self.guard = Guard(ctx.name, ExternalCall(service="http", timeout_ms=int(self.settings.timeout_s * 1000),
                                                      retries=DEFAULT_CALLS["http"].retries), (WebhookUnavailable,))

    def ready(self) -> bool:
        return self.guard.available()

    def setup(self) -> None:
        missing = [var for var in self.settings.headers_from_env.values() if var not in os.environ]
        if missing:
            raise TopologyError(f"{self.name}: the webhook's header values come from {', '.join(missing)}, "
                                "which the environment does not set")
        self.headers = {"Content-Type": "application/json",
                        **{h: os.environ[var] for h, var in self.settings.headers_from_env.items()}}

    def write(self, values: Sequence[Any], records: Sequence[Record]) -> Mapping[int, BaseException] | None:
        body = json.dumps({"records": list(values)}, default=_jsonable).encode()
        key = hashlib.sha256(b"|".join(r.header("event_id").encode() for r in records)).hexdigest()
        request = urllib.request.Request(self.settings.url, data=body, method="POST",
                                         headers={**self.headers, "Idempotency-Key": key})


        def post() -> WebhookError | None:
            try:
                with urllib.request.urlopen(request, timeout=self.guard.timeout_s) as response:  # noqa: S310
                    response.read()
                return None
            except urllib.error.HTTPError as exc:
                detail = exc.read(300).decode("utf-8", "replace")
                if 400 <= exc.code < 500:
                    return WebhookError(f"{self.settings.url} answered {exc.code}: {detail}")
                raise WebhookUnavailable(f"{self.settings.url} answered {exc.code}: {detail}") from exc
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                raise WebhookUnavailable(f"{self.settings.url} did not answer: {exc}") from exc

        refused = self.guard.call(post)  # ServiceUnavailableError (backpressure) when the endpoint is down
        return None if refused is None else {i: refused for i in range(len(values))}


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON")
