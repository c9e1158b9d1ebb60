"""``python -m streams.registry --host 127.0.0.1 --port 8081 --bootstrap 127.0.0.1:9092 [--users users.json]``.

Replays ``_schemas``, listens, logs ``ready``; stops gracefully on SIGTERM or SIGINT. Its Kafka
clients connect as ``TANGRAM_KAFKA_SECURITY`` says (the registry's own principal on a secured
stack); with ``--users`` every request needs basic auth (``streams.registry.auth``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from streams.errors import TangramError
from streams.registry.app import Registry, create_app
from streams.registry.auth import RegistryUsers
from streams.registry.log import TOPIC, KafkaLog
from streams.security.kafka import KafkaConnection, KafkaSecurity

log = logging.getLogger("tangram.registry")


async def serve(host: str, port: int, kafka: KafkaConnection, topic: str, users: RegistryUsers | None = None,
                replication_factor: int = -1) -> None:
    """Load the registry from Kafka, serve HTTP until SIGTERM/SIGINT."""
    kafka_log = KafkaLog(kafka, topic, replication_factor=replication_factor)
    registry = Registry(kafka_log)
    count = await asyncio.to_thread(registry.load)
    log.info("replayed %d record(s) from %s: %d subject(s)", count, topic, len(registry.state.subjects))

    runner = web.AppRunner(create_app(registry, users), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("ready: schema registry on http://%s:%d (Kafka %s, topic %s, %s)", host, port, kafka, topic,
             f"basic auth, {len(users.users)} user(s)" if users else "no auth")
    print("ready", flush=True)
    await stop.wait()
    log.info("stopping")
    await runner.cleanup()
    await asyncio.to_thread(kafka_log.close)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streams.registry", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092", help="Kafka bootstrap servers")
    parser.add_argument("--topic", default=TOPIC, help="compacted topic holding the schemas")
    parser.add_argument("--users", type=Path, help="users file (roles, scrypt hashes): require basic auth")
    parser.add_argument("--replication-factor", type=int, default=-1,
                        help="of the topic, when the registry creates it (-1: the cluster's default.replication.factor)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        kafka = KafkaConnection(args.bootstrap, KafkaSecurity.from_environ(os.environ))
        users = RegistryUsers.load(args.users) if args.users else None
        asyncio.run(serve(args.host, args.port, kafka, args.topic, users, args.replication_factor))
    except TangramError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
