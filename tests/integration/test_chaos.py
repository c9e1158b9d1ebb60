"""``tangram chaos`` on the reference app, short campaign: every processor fault, Redis and Triton frozen, the
broker killed, the registry down while a processor starts, an oversize record — under load, with every event
accounted for by id at the end.

What must hold everywhere (the runtime's guarantees): something was sent and all of it acknowledged; no
event lost; every window the accepted readings make emitted, none incomplete; one prediction per window;
no dead letter outside the feature stage for any (valid) event; every fault recovered. What the feature
stage's at-least-once recovery dead-letters as late after its kill (re-reads, issue #21 item 2, worked on
in the feature stage) and the duplicates at-least-once allows are printed, measured, not asserted away.
"""

from __future__ import annotations

import pytest

from reference import REPO
from streams.chaos import Campaign, print_report

pytestmark = pytest.mark.integration

FAULTS = ("kill:ingest", "kill:features", "kill:inference", "kill:rules", "freeze:redis", "freeze:triton",
          "kill:broker", "registry-at-start:rules", "oversize")


def test_short_chaos_campaign_loses_nothing_and_recovers_from_every_fault(stack, capsys):
    campaign = Campaign(REPO / "topologies" / "predictive_maintenance", stack, faults=FAULTS, rate=100.0,
                        fault_s=5.0)
    try:
        report = campaign.run()
    finally:
        campaign.close()
    with capsys.disabled():
        from rich.console import Console

        print_report(report, Console(width=140))
        print(report.to_json())
    a = report.accounting
    assert a.produced > 0 and a.sent == a.produced and a.refused_by_broker == 0, "not everything was acknowledged"
    assert a.accepted > 0 and a.lost == 0, f"{a.lost} events lost"
    assert a.windows_expected > 0 and a.windows_missing == 0 and a.windows_incomplete == 0
    assert a.predictions_missing == 0
    outside_features = {r: n for r, n in a.false_dead_letters.items() if not r.startswith("features:")}
    assert outside_features == {}, f"false dead letters outside the feature stage: {outside_features}"
    assert a.oversize_sent == 1 and a.oversize_refused == 1
    assert a.oversize_dead_lettered >= 1 and a.oversize_truncated == a.oversize_dead_lettered  # kept truncated
    for fault in report.faults:
        assert fault.recovery_s is not None, f"{fault.fault} did not recover within the timeout"
        if fault.fault.startswith("registry-at-start"):
            assert "waited for the registry" in fault.note
