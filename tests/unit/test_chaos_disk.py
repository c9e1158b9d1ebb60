"""The disk-full fault fills only a filesystem of Kafka's own: never the machine's disk."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from streams.errors import StackError
from streams.settings import StackSettings
from streams.stack.kafka import kafka_disk


def test_a_log_directory_on_the_machines_disk_is_refused_with_how_to_mount_one(tmp_path):
    settings = StackSettings(home=tmp_path)
    with pytest.raises(StackError, match=r"on a filesystem of its own: mount a small filesystem .*mount -t tmpfs"):
        kafka_disk(settings)


def test_a_small_filesystem_of_its_own_is_the_one_filled_and_a_large_one_is_refused(tmp_path):
    """Run in a mount namespace of its own (``unshare``; as an unprivileged user, in a user namespace too):
    the tmpfs mounts are seen by this check only and vanish with it."""
    data = tmp_path / "kafka" / "data"
    data.mkdir(parents=True)
    check = f"""
import sys
from pathlib import Path
from streams.errors import StackError
from streams.settings import StackSettings
from streams.stack.kafka import kafka_disk
settings = StackSettings(home=Path({str(tmp_path)!r}))
assert kafka_disk(settings) == Path({str(data)!r}), "the small filesystem"
"""
    small = _in_namespace(f"mount -t tmpfs -o size=16m tmpfs {data}", check)
    assert small.returncode == 0, small.stderr
    large = _in_namespace(f"mount -t tmpfs -o size=3g tmpfs {data}", check)
    assert large.returncode != 0 and "GiB free): give the log directory a smaller one" in large.stderr, large.stderr


def _in_namespace(mount: str, check: str) -> subprocess.CompletedProcess:
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    return subprocess.run(["unshare", *user, "--mount", "sh", "-c", f'{mount} && exec "$0" -c "$1"', sys.executable,
                           check], capture_output=True, text=True, timeout=60)
