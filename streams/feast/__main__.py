"""``python -m streams.feast apply|sync|get`` (run with ``.venv-feast/bin/python``).

    apply  write the Feast repository for the declared feature sets and register them (FeatureStore.apply)
    get    read entities back through Feast's online store (get_online_features), as JSON
    sync   backfill: push the rows of a features topic into Feast's online store (the engines
           write it themselves; this refills it, e.g. a new or emptied Redis, from the topic)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from streams.features.spec import load_feature_set
from streams.security.kafka import KafkaConnection, KafkaSecurity
from streams.feast.repo import default_home, default_redis, repo_dir


def _kafka_default() -> str:
    host = os.environ.get("TANGRAM_KAFKA_HOST") or os.environ.get("TANGRAM_HOST", "127.0.0.1")
    return f"{host}:{os.environ.get('TANGRAM_KAFKA_PORT', '9092')}"


def _registry_default() -> str:
    host = os.environ.get("TANGRAM_REGISTRY_HOST") or os.environ.get("TANGRAM_HOST", "127.0.0.1")
    return f"http://{host}:{os.environ.get('TANGRAM_REGISTRY_PORT', '8081')}"


def _shown(path: str) -> str:
    """A declaration's path as the generated files name it: relative to the working directory when inside it."""
    resolved, here = Path(path).resolve(), Path.cwd()
    return str(resolved.relative_to(here)) if resolved.is_relative_to(here) else str(resolved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streams.feast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", default=str(default_home()),
                        help="TANGRAM_HOME; the repository is <home>/feast/repo (default: %(default)s)")
    common.add_argument("--feature-set", action="append", required=True,
                        help="a feature-set declaration (repeatable for apply)")

    p_apply = sub.add_parser("apply", parents=[common], help="write the repository and register it with Feast")
    p_apply.add_argument("--redis", default=default_redis(),
                         help="Feast's online store, host:port (default: %(default)s)")
    p_apply.add_argument("--project", required=True,
                         help="Feast project: the one the engines write to, the topology's app")

    p_sync = sub.add_parser("sync", parents=[common],
                            help="backfill: push a features topic's rows into Feast's online store")
    p_sync.add_argument("--bootstrap", default=_kafka_default())
    p_sync.add_argument("--registry", default=_registry_default(), help="schema registry URL")
    p_sync.add_argument("--topic", help="features topic (default: the declaration's output topic)")
    p_sync.add_argument("--group", help="consumer group (default: tangram-feast-<feature set>)")
    p_sync.add_argument("--batch", type=int, default=1000, help="records per push at most")
    p_sync.add_argument("--until-idle-s", type=float, default=None, help="stop after this long without a record")
    p_sync.add_argument("--max-records", type=int, default=None, help="stop after this many records")

    p_get = sub.add_parser("get", parents=[common], help="online features of entities through Feast, as JSON")
    p_get.add_argument("entity_ids", nargs="+")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    feature_sets = [(load_feature_set(p), _shown(p)) for p in args.feature_set]
    repo = str(repo_dir(args.home))

    if args.command == "apply":
        from streams.feast.repo import apply
        root, applied = apply(feature_sets, home=args.home, redis=args.redis, project=args.project)
        print(json.dumps({"repo": str(root), "applied": applied}))
        return 0

    if len(feature_sets) != 1:
        parser.error(f"{args.command} takes one --feature-set")
    fs = feature_sets[0][0]
    if args.command == "sync":
        from streams.feast.bridge import sync
        kafka = KafkaConnection(args.bootstrap, KafkaSecurity.from_environ(os.environ))
        stats = sync(fs, repo=repo, kafka=kafka, registry=args.registry,
                     topic=args.topic or fs.output.topic, group=args.group or f"tangram-feast-{fs.name}",
                     batch=args.batch, until_idle_s=args.until_idle_s, max_records=args.max_records)
        print(json.dumps(stats.as_dict()))
        return 0

    from streams.feast.bridge import get_online
    print(json.dumps(get_online(repo, fs, args.entity_ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
