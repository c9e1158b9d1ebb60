"""``tangram chaos`` on the reference app, short campaign: every processor fault, Redis and Triton frozen, the
broker killed, the registry down while a processor starts, an oversize record — under load, with every event
accounted for by id at the end; and, on a three-node stack with the app's topics replicated three times
with two in sync, one broker of three killed, and one's disk filled.

What must hold everywhere (the runtime's guarantees): something was sent and all of it acknowledged; no
event lost; every window the accepted readings make emitted, none incomplete; one prediction per window;
no dead letter for any valid event (the feature stage tells the re-reads after its restart from late
data); every fault recovered. The duplicates at-least-once allows are printed, measured, not asserted away.
"""

from __future__ import annotations

import pytest

from confluent_kafka.admin import AdminClient

from reference import REPO
from streams.chaos import Campaign, Report, print_report

pytestmark = pytest.mark.integration

FAULTS = ("kill:ingest", "kill:features", "kill:inference", "kill:rules", "freeze:redis", "freeze:triton",
          "kill:broker", "registry-at-start:rules", "oversize")


def _run(stack, faults: tuple[str, ...], capsys) -> tuple[Campaign, Report]:
    campaign = Campaign(REPO / "topologies" / "predictive_maintenance", stack, faults=faults, rate=100.0, fault_s=5.0)
    try:
        report = campaign.run()
    finally:
        campaign.close()
    with capsys.disabled():
        from rich.console import Console

        print_report(report, Console(width=140))
        print(report.to_json())
    return campaign, report


def _nothing_lost(report: Report) -> None:
    a = report.accounting
    assert a.produced > 0 and a.sent == a.produced and a.refused_by_broker == 0, "not everything was acknowledged"
    assert a.accepted > 0 and a.lost == 0, f"{a.lost} events lost"
    assert a.windows_expected > 0 and a.windows_missing == 0 and a.windows_incomplete == 0
    assert a.predictions_missing == 0
    for fault in report.faults:
        assert fault.recovery_s is not None, f"{fault.fault} did not recover within the timeout"


def test_short_chaos_campaign_loses_nothing_and_recovers_from_every_fault(stack, capsys):
    _, report = _run(stack, FAULTS, capsys)
    _nothing_lost(report)
    a = report.accounting
    assert a.false_dead_letters == {}, f"valid events dead-lettered: {a.false_dead_letters}"
    assert a.oversize_sent == 1 and a.oversize_refused == 1
    assert a.oversize_dead_lettered >= 1 and a.oversize_truncated == a.oversize_dead_lettered  # kept truncated
    for fault in report.faults:
        if fault.fault.startswith("registry-at-start"):
            assert "waited for the registry" in fault.note


def test_one_broker_of_three_killed_under_load_loses_nothing(three_node_stack, capsys):
    campaign, report = _run(three_node_stack, ("kill:broker",), capsys)
    _nothing_lost(report)
    assert report.accounting.false_dead_letters == {}
    [fault] = report.faults
    # the two live nodes carry the chain: every group commits past its inputs' ends with node 1 still down
    assert fault.note.startswith("broker kill -9 (node 1 of 3); with it down the chain caught up in "), fault.note
    # the killed node held a replica of every partition of the campaign's topics, and led some of them
    admin = AdminClient(three_node_stack.kafka.config())
    topics = {name: t for name, t in admin.list_topics(timeout=10).topics.items() if name.startswith(campaign.prefix)}
    assert len(topics) == len(campaign.topology.topics)
    partitions = [p for t in topics.values() for p in t.partitions.values()]
    assert all(sorted(p.replicas) == [1, 2, 3] for p in partitions)
    assert report.replication == 3 and report.brokers == 3


def test_full_disk_under_one_broker_of_three_loses_nothing(three_node_stack, capsys):
    """Node 1's log directory (a 256 MiB filesystem of its own) filled to the last byte under load: Kafka takes
    the directory offline and the node stops itself; the other two serve on; with the space back it starts
    again. Every reading acknowledged and accepted, none lost, every window complete, no dead letter."""
    _, report = _run(three_node_stack, ("disk-full:broker",), capsys)
    _nothing_lost(report)
    assert report.accounting.false_dead_letters == {}
    [fault] = report.faults
    assert fault.note.startswith("broker's disk full (node 1 of 3) for 5 s ("), fault.note
    assert "it stopped itself" in fault.note, f"the full disk did not reach the broker: {fault.note}"
