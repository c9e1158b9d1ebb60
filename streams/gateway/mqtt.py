"""MQTT ingest: subscribe to a broker (Mosquitto), forward validated readings to Kafka as Avro.

Devices publish one JSON reading per message (QoS 1) on the topics the stream declares
(``mqtt_topics: [pm/telemetry/+]``). The adapter holds a persistent session (fixed client id,
``clean_session=False``) and acknowledges a message to the broker (PUBACK, paho's manual ack)
only after Kafka acknowledged what it became: the reading on the ingest topic, or its dead
letter on the DLQ. A crash in between means the broker redelivers it; the duplicate is
dropped by ``event_id``. A device cannot be told to slow down, so readings over a rate limit
go to the DLQ with reason ``rate_limited`` (counted), like every other refusal.

The adapter logs in to the broker (``username``/``password``, the app's gateway principal); the
broker's password and ACL files (``streams.gateway.mqtt_auth``) let each device publish on its
own topic only, so the topic names the device. Each device topic has a dead-letter budget: once
it is spent, its refused messages are acknowledged and counted but not written, so one device
cannot fill the DLQ.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from prometheus_client import Counter
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from streams.gateway.errors import GatewayError
from streams.gateway.quota import Limits, Quotas
from streams.gateway.sink import KafkaSink
from streams.gateway.stream import IngestStream
from streams.ingest import Rejected
from streams.settings import StackSettings
from streams.topology import load_topology

log = logging.getLogger("tangram.gateway.mqtt")

MESSAGES = Counter("tangram_gateway_mqtt_messages_total", "MQTT messages by outcome.", ["stream", "outcome"])


class MqttGatewaySettings(BaseSettings):
    """Which broker the MQTT adapter subscribes to; ``TANGRAM_MQTT_*`` overrides."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_MQTT_", frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="MQTT broker address.")
    port: int = Field(1883, ge=1, le=65535, description="MQTT broker port.")
    client_id: str = Field("", description="Session id at the broker; default `tangram-<app>-<stream>` (persistent).")
    qos: int = Field(1, ge=0, le=2, description="Subscription QoS (1: at-least-once from the device).")
    keepalive_s: int = Field(30, ge=5, description="MQTT keepalive.")
    connect_timeout_s: float = Field(10.0, gt=0, description="How long to wait for the broker at start.")
    username: str | None = Field(None, description="The adapter's user at the broker (the app's gateway principal).")
    password: SecretStr | None = Field(None, description="Its password (from a secret).")
    dlq_per_hour: int = Field(1000, ge=0, description="Dead letters each device topic may cause per hour; beyond, "
                                                      "its refused messages are counted and dropped.")


class MqttGateway:
    """One stream's MQTT adapter: ``start()`` connects and subscribes, ``stop()`` drains and disconnects."""

    def __init__(self, stream: IngestStream, topics: list[str], sink: KafkaSink, settings: MqttGatewaySettings,
                 client_id: str):
        if not topics:
            raise GatewayError(f"gateway stream {stream.name!r} declares no `mqtt_topics:`; nothing to subscribe to")
        self.stream = stream
        self.topics = topics
        self.sink = sink
        self.settings = settings
        self._subscribed = threading.Event()
        self._refused: str | None = None
        self._lock = threading.Lock()  # the validator's state is shared by the network thread only, but be explicit
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False,
                                  protocol=mqtt.MQTTv311, manual_ack=True)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.client.on_disconnect = self._on_disconnect
        if settings.username:
            self.client.username_pw_set(settings.username,
                                        settings.password.get_secret_value() if settings.password else None)
        self.quotas = Quotas("mqtt")
        # a device cannot be slowed down, so its rate is the topology's per-client limit (a dead letter
        # beyond it); what is budgeted here is the dead letters
        self.limits = Limits(rate_per_s=1e9, burst=10**9, dlq_per_hour=settings.dlq_per_hour)

    def start(self) -> None:
        s = self.settings
        try:
            self.client.connect(s.host, s.port, keepalive=s.keepalive_s)
        except OSError as exc:
            raise GatewayError(f"cannot reach the MQTT broker at {s.host}:{s.port}: {exc}; is mosquitto running?") from exc
        self.client.loop_start()
        if not self._subscribed.wait(s.connect_timeout_s):
            self.stop()
            if self._refused:
                raise GatewayError(f"the MQTT broker at {s.host}:{s.port} refused the adapter ({self._refused}); "
                                   "check its username and password")
            raise GatewayError(f"MQTT broker at {s.host}:{s.port} did not accept the subscription to "
                               f"{', '.join(self.topics)} within {s.connect_timeout_s}s")
        log.info("%s: MQTT %s:%d %s → %s", self.stream.name, s.host, s.port, ",".join(self.topics), self.stream.output_topic)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    # -- paho callbacks (network thread) -------------------------------------------
    def _on_connect(self, client: mqtt.Client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("MQTT connection refused: %s", reason_code)
            self._refused = str(reason_code)
            return
        client.subscribe([(t, self.settings.qos) for t in self.topics])

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        if any(rc.is_failure for rc in reason_codes):
            log.error("MQTT subscription to %s refused: %s", self.topics, reason_codes)
            return
        self._subscribed.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("MQTT disconnected (%s); paho reconnects, unacknowledged messages are redelivered", reason_code)

    def _on_message(self, client: mqtt.Client, userdata, msg: mqtt.MQTTMessage) -> None:
        stream, source = self.stream, f"mqtt:{msg.topic}"
        now_ms = int(time.time() * 1000)
        with self._lock:
            try:
                record = stream.validator.admit(None, msg.payload, now_ms, client=msg.topic)
            except Rejected as exc:
                log.info("%s mid=%d refused: %s: %s", source, msg.mid, exc.reason, exc)
                if self.quotas.dead_letters(msg.topic, self.limits, 1) > 0:  # its budget is spent: counted, not written
                    MESSAGES.labels(stream.name, "dlq_budget").inc()
                    self._ack(msg)
                    return
                MESSAGES.labels(stream.name, "rejected").inc()
                output = stream.rejected(exc, msg.payload, source, client=msg.topic, offset=msg.mid)
                record = None
            else:
                if record is None:  # a duplicate (e.g. redelivered after a crash): already in Kafka
                    MESSAGES.labels(stream.name, "duplicate").inc()
                    self._ack(msg)
                    return
                output = stream.accepted(record, None, now_ms)
                MESSAGES.labels(stream.name, "accepted").inc()

        def done(failures: list[str]) -> None:
            if failures:  # not acknowledged: the broker redelivers after a reconnect; let the retry through dedup
                log.error("%s mid=%d not delivered to Kafka (%s); not acknowledging it to the broker", source, msg.mid,
                          "; ".join(failures))
                if record is not None:
                    with self._lock:
                        stream.validator.forget([record])
                return
            self._ack(msg)

        self.sink.produce([output], done)

    def _ack(self, msg: mqtt.MQTTMessage) -> None:
        if msg.qos > 0:
            self.client.ack(msg.mid, msg.qos)


def serve(topology_path: str | Path, names: list[str] | None, stack: StackSettings, settings: MqttGatewaySettings,
          stop: threading.Event | None = None) -> None:
    """Run the MQTT adapters of the named streams (all with `mqtt_topics`) until SIGINT/SIGTERM or ``stop``."""
    topology = load_topology(topology_path)
    names = names or [n for n, g in topology.gateways.items() if g.mqtt_topics]
    if not names:
        raise GatewayError(f"topology {topology.app!r} declares no gateway stream with `mqtt_topics:`")
    sink = KafkaSink(stack.kafka, f"{topology.app}.gateway.mqtt", name="gateway.mqtt")
    stop = stop or threading.Event()
    gateways = []
    try:
        for name in names:
            stream = IngestStream.from_topology(topology, name, stack)
            gateway = MqttGateway(stream, topology.gateways[name].mqtt_topics, sink, settings,
                                  settings.client_id or f"tangram-{topology.app}-{name}")
            gateway.start()
            gateways.append(gateway)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        for gateway in gateways:  # no new messages; then let Kafka acknowledge (and the broker hear) the last ones
            gateway.client.unsubscribe(gateway.topics)
        sink.close()
        for gateway in gateways:
            gateway.stop()
