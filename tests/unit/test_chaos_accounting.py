"""``tangram chaos``'s verdict: it never passes on nothing sent, on a loss, or on a valid event dead-lettered."""

from __future__ import annotations

from streams.accounting import Accounting


def _good(**changes) -> Accounting:
    a = Accounting(sent=100, produced=100, accepted=100, windows_expected=2, windows_delivered=2)
    for k, v in changes.items():
        setattr(a, k, v)
    return a


def test_a_clean_run_passes():
    assert _good().ok and _good().clean(exactly_once=False) and _good().clean(exactly_once=True)


def test_nothing_sent_never_passes():
    assert not Accounting().ok
    assert not _good(sent=0, produced=0, accepted=0).ok


def test_unacknowledged_lost_or_incomplete_fail():
    assert not _good(sent=99).ok  # one produced, never acknowledged
    assert not _good(refused_by_broker=1).ok
    assert not _good(lost=1).ok
    assert not _good(windows_missing=1).ok
    assert not _good(windows_incomplete=1).ok
    assert not _good(predictions_missing=1).ok


def test_false_dead_letters_fail_and_duplicates_fail_only_in_exactly_once_mode():
    assert not _good(false_dead_letters={"features:late": 3}).clean(exactly_once=False)
    assert _good(duplicated=2).clean(exactly_once=False)
    assert not _good(duplicated=2).clean(exactly_once=True)
    assert not _good(predictions_duplicated=1).clean(exactly_once=True)
