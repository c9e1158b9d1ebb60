"""Which gateway processes an app runs, read from its topology: what docker-compose, the Helm chart and the
Prometheus scrape config deploy for it.

===========  =====================================================  ==========================================
process      serves                                                 command
===========  =====================================================  ==========================================
``http``     every stream under ``gateways:``                       ``tangram gateway http APP --stream S ...``
``upload``   every upload under ``uploads:``                        ``tangram gateway upload APP ...``
``mqtt``     the gateway streams that declare ``mqtt_topics:``      ``tangram gateway mqtt APP --stream S ...``
===========  =====================================================  ==========================================

All of them run as the app's one gateway principal (:func:`streams.security.acls.gateway_principal`). The two
HTTP gateways listen on a port (their settings' default) and answer ``/healthz``; the MQTT adapter only
connects out, to the broker. :func:`gateway_command` is the command line each runs in a container: the
compose services and the chart's Deployments run exactly it, and the tests parse it with the CLI.
"""

from __future__ import annotations

from typing import Literal

from streams.gateway.http import HttpGatewaySettings
from streams.gateway.upload import UploadGatewaySettings
from streams.topology import Topology

Kind = Literal["http", "upload", "mqtt"]

#: The port each HTTP gateway listens on unless told otherwise (``--port``); the MQTT adapter listens on none.
LISTEN_PORTS: dict[Kind, int] = {
    "http": HttpGatewaySettings.model_fields["port"].default,
    "upload": UploadGatewaySettings.model_fields["port"].default,
}


def gateway_processes(topology: Topology) -> dict[Kind, list[str]]:
    """The gateway processes ``topology`` needs, each with the streams (or uploads) it serves; none if it
    declares no gateway stream and no upload."""
    out: dict[Kind, list[str]] = {}
    if topology.gateways:
        out["http"] = list(topology.gateways)
    if topology.uploads:
        out["upload"] = list(topology.uploads)
    mqtt = [name for name, gateway in topology.gateways.items() if gateway.mqtt_topics]
    if mqtt:
        out["mqtt"] = mqtt
    return out


def compose_service(kind: Kind) -> str:
    """The docker-compose service (and the Kubernetes name suffix) of a gateway process: ``gateway-http``."""
    return f"gateway-{kind}"


def gateway_command(kind: Kind, app_path: str, streams: list[str], *, metrics_port: int) -> list[str]:
    """The ``tangram`` arguments of gateway process ``kind`` in a container: listening on every interface of
    it at its default port (HTTP gateways), its metrics on ``metrics_port``. ``streams``: what
    :func:`gateway_processes` gave it (the upload gateway serves every upload, so takes none). The MQTT
    adapter's broker and its user there come from the environment (``TANGRAM_MQTT_HOST``, ``_PORT``,
    ``_USERNAME``, ``_PASSWORD``), so the command is the same wherever the broker is."""
    args = ["gateway", kind, app_path]
    if kind != "upload":
        for stream in streams:
            args += ["--stream", stream]
    if kind != "mqtt":
        args += ["--host", "0.0.0.0", "--port", str(LISTEN_PORTS[kind])]
    return [*args, "--metrics-port", str(metrics_port)]
