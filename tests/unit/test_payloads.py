"""Payloads by reference (streams.payloads): inline under the declared limit, content-addressed above it."""

from __future__ import annotations

import hashlib

import pytest

from streams.errors import PayloadError
from streams.payloads import PayloadStore
from streams.settings import StackSettings
from streams.topology import PayloadsSpec, Topology


def test_small_values_stay_inline_and_large_ones_travel_by_their_digest(tmp_path):
    store = PayloadStore(tmp_path, inline_max_bytes=10)
    assert store.inline(b"0123456789", "image") == {"image": b"0123456789", "image_ref": None}
    big = b"x" * 11
    fields = store.inline(big, "image")
    assert fields["image"] is None and fields["image_ref"] == "sha256:" + hashlib.sha256(big).hexdigest()
    assert store.value(fields, "image") == big and store.value({"image": b"abc"}, "image") == b"abc"
    assert store.put(big) == fields["image_ref"]  # the same bytes again: the same reference, one file
    assert len(list(tmp_path.rglob("*"))) == 2  # its folder and the one file


def test_a_missing_or_altered_payload_is_an_error_that_says_which(tmp_path):
    store = PayloadStore(tmp_path, inline_max_bytes=1)
    reference = store.put(b"scan")
    next(p for p in tmp_path.rglob("*") if p.is_file()).write_bytes(b"forged")
    with pytest.raises(PayloadError, match="does not match its digest"):
        store.get(reference)
    with pytest.raises(PayloadError, match="is not in the store"):
        store.get("sha256:" + "0" * 64)
    with pytest.raises(PayloadError, match="not a payload reference"):
        store.get("../../etc/passwd")
    with pytest.raises(PayloadError, match="neither 'image' nor 'image_ref'"):
        store.value({"image": None, "image_ref": None}, "image")


def test_the_store_is_where_the_topology_says_relative_to_the_stack_home(tmp_path):
    topology = Topology.model_construct(app="a", payloads=PayloadsSpec(inline_max_bytes=5, store="blobs"), topics={})
    store = PayloadStore.of(topology, StackSettings(home=tmp_path))
    assert store.root == tmp_path / "blobs" and store.inline_max_bytes == 5
    absolute = Topology.model_construct(app="a", payloads=PayloadsSpec(store=str(tmp_path / "shared")), topics={})
    assert PayloadStore.of(absolute, StackSettings(home=tmp_path)).root == tmp_path / "shared"


def test_an_inline_limit_over_what_kafka_takes_by_default_is_refused():
    with pytest.raises(ValueError, match="900000"):
        PayloadsSpec(inline_max_bytes=2_000_000)
