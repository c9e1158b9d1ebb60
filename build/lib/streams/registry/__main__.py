"""``python -m streams.registry --host 127.0.0.1 --port 8081 --bootstrap 127.0.0.1:9092``.

Replays ``_schemas``, listens, logs ``ready``; stops gracefully on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from streams.errors import TangramError
from streams.registry.app import Registry, create_app
from streams.registry.log import TOPIC, KafkaLog

log = logging.getLogger("tangram.registry")


async def serve(host: str, port: int, bootstrap: str, topic: str) -> None:
    """Load the registry from Kafka, serve HTTP until SIGTERM/SIGINT."""
    kafka_log = KafkaLog(bootstrap, topic)
    registry = Registry(kafka_log)
    count = await asyncio.to_thread(registry.load)
    log.info("replayed %d record(s) from %s: %d subject(s)", count, topic, len(registry.state.subjects))

    runner = web.AppRunner(create_app(registry), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("ready: schema registry on http://%s:%d (bootstrap %s, topic %s)", host, port, bootstrap, topic)
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        asyncio.run(serve(args.host, args.port, args.bootstrap, args.topic))
    except TangramError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
