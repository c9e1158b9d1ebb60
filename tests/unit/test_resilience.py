"""The resilience layer: deadline, retries with jittered backoff, circuit breaker, from the topology's `calls:`."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from streams.errors import BackpressureError, ServiceUnavailableError
from streams.resilience import Calls, Guard
from streams.topology import ExternalCall


class Down(ConnectionError):
    pass


def _guard(retries: int = 2, failures: int | None = 3, reset_s: float = 0.3, name: str = "p") -> Guard:
    breaker = {"failures": failures, "reset_s": reset_s} if failures else None
    call = ExternalCall(service="redis", timeout_ms=50, retries=retries, circuit_breaker=breaker)
    return Guard(name, call, (Down,), sleep=lambda _: None)


class Flaky:
    def __init__(self, fail: int):
        self.fail, self.calls = fail, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.fail:
            raise Down(f"refused #{self.calls}")
        return "ok"


def breaker_state(processor: str, service: str = "redis") -> float:
    return REGISTRY.get_sample_value("tangram_calls_breaker_state", {"processor": processor, "service": service})


def test_a_failure_is_tried_again_as_declared_and_the_answer_returned():
    guard, fn = _guard(retries=2, failures=None, name="retry-ok"), Flaky(fail=2)
    assert guard.call(fn) == "ok" and fn.calls == 3


def test_tries_spent_raise_backpressure_naming_the_service():
    guard, fn = _guard(retries=1, failures=None, name="retry-spent"), Flaky(fail=10)
    with pytest.raises(ServiceUnavailableError, match="redis unavailable") as info:
        guard.call(fn)
    assert isinstance(info.value, BackpressureError) and info.value.service == "redis"
    assert fn.calls == 2


def test_what_is_not_a_service_failure_passes_through_untried():
    guard = _guard(name="not-a-failure")
    calls = []

    def refuses() -> None:
        calls.append(1)
        raise ValueError("the record's fault")

    for _ in range(5):
        with pytest.raises(ValueError):
            guard.call(refuses)
    assert len(calls) == 5 and guard.available()  # never retried, never opens the breaker


def test_the_breaker_opens_at_the_declared_failures_rejects_without_calling_then_closes_on_a_trial():
    guard, fn = _guard(retries=0, failures=3, reset_s=0.3, name="breaker"), Flaky(fail=3)
    for _ in range(3):
        with pytest.raises(ServiceUnavailableError):
            guard.call(fn)
    assert fn.calls == 3 and not guard.available() and guard.state == "open"
    assert breaker_state("breaker") == 2
    with pytest.raises(ServiceUnavailableError, match="circuit breaker open"):
        guard.call(fn)
    assert fn.calls == 3  # rejected: no call went out
    assert guard.probe(fn) is False and fn.calls == 3  # not ready, and no call either
    time.sleep(0.35)
    assert guard.state == "half-open" and guard.available()
    assert guard.probe(fn) is True and fn.calls == 4  # the trial call closes it
    assert guard.state == "closed" and breaker_state("breaker") == 0


def test_retries_stop_once_the_breaker_opens():
    guard, fn = _guard(retries=10, failures=2, name="stop-on-open"), Flaky(fail=100)
    with pytest.raises(ServiceUnavailableError):
        guard.call(fn)
    assert fn.calls == 2


def test_the_final_error_names_and_chains_the_services_own_failure_also_when_the_breaker_trips_on_it():
    """pybreaker raises its own error on the failure that opens it; the user still reads what failed."""
    guard, fn = _guard(retries=4, failures=5, name="names-cause"), Flaky(fail=100)
    with pytest.raises(ServiceUnavailableError, match=r"5 tries .*breaker open.*refused #5") as info:
        guard.call(fn)
    assert isinstance(info.value.__cause__, Down) and str(info.value.__cause__) == "refused #5"
    with pytest.raises(ServiceUnavailableError, match=r"circuit breaker open.*last failure: refused #5") as info:
        guard.call(fn)  # rejected without a call: the last failure is still named
    assert isinstance(info.value.__cause__, Down) and fn.calls == 5


def test_async_calls_share_the_policy():
    guard = _guard(retries=1, failures=2, name="async")
    calls = []

    async def down() -> None:
        calls.append(1)
        raise Down("no")

    async def ok() -> int:
        return 7

    async def scenario() -> None:
        with pytest.raises(ServiceUnavailableError):
            await guard.acall(down)
        assert not guard.available() and len(calls) == 2
        with pytest.raises(ServiceUnavailableError, match="open"):
            await guard.acall(ok)
        assert await guard.aprobe(ok) is False

    asyncio.run(scenario())


def test_the_worst_case_is_bounded_by_deadline_tries_and_waits():
    call = ExternalCall(service="triton", timeout_ms=2000, retries=4)
    guard = Guard("bound", call, (Down,))
    assert guard.timeout_s == 2.0 and guard.tries == 5
    assert 10.0 < guard.worst_case_s() <= 10.0 + 4 * 2.0


def test_calls_use_the_declaration_or_the_default_and_one_guard_per_service():
    calls = Calls("rules", [ExternalCall(service="redis", timeout_ms=700, retries=1)])
    redis = calls.guard("redis", (Down,))
    assert redis is calls.guard("redis", (Down,)) and redis.timeout_s == 0.7 and redis.tries == 2
    registry = calls.guard("registry", (Down,))
    assert registry.timeout_s == 5.0 and registry.breaker is None
    with pytest.raises(ValueError, match="twice"):
        Calls("x", [ExternalCall(service="redis", timeout_ms=1), ExternalCall(service="redis", timeout_ms=2)])
