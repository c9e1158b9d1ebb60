"""The Flink job gets the stack's Kafka security and registry credentials the way every client does."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from streams.flink.launcher import job_env
from streams.security.kafka import KafkaSecurity
from streams.settings import StackSettings
from streams.wire import RegistryREST

SCRAM = KafkaSecurity(protocol="SASL_SSL", username="pm.features", password="p@ss:w", ca_file="/ca.pem")


def test_the_job_process_gets_the_stack_kafka_security_whole(monkeypatch):
    monkeypatch.setenv("TANGRAM_KAFKA_SECURITY__USERNAME", "someone-else")
    env = job_env(StackSettings(kafka_security=SCRAM))
    assert "TANGRAM_KAFKA_SECURITY__USERNAME" not in env
    assert KafkaSecurity.from_environ(env) == SCRAM  # what streams.flink.job renders into properties.*
    plain = job_env(StackSettings(kafka_security=KafkaSecurity()))
    assert KafkaSecurity.from_environ({k: v for k, v in plain.items() if not k.startswith("TANGRAM_KAFKA_SECURITY__")
                                       }).secured is False


def test_registry_rest_sends_the_url_user_as_basic_auth_and_never_shows_it():
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"schema": json.dumps({"type": "string"})}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        registry = RegistryREST(f"http://tangram-reader:p%40ss@127.0.0.1:{port}")
        assert registry.latest("pm.features.device_window-value") == {"type": "string"}
        assert registry.url == f"http://127.0.0.1:{port}"
        assert seen == ["Basic " + base64.b64encode(b"tangram-reader:p@ss").decode()]
        assert RegistryREST(f"http://127.0.0.1:{port}").schema(1) == {"type": "string"} and seen[-1] is None
    finally:
        server.shutdown()
