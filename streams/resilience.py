"""One way to survive a failing service: every call a processor makes outside Kafka goes through here.

A topology declares each processor's external calls (``calls:``): the service (``triton``,
``redis``, ``registry``, ``http``), the deadline of one call (``timeout_ms``), how many times it is
tried again (``retries``) and its circuit breaker (``circuit_breaker: {failures, reset_s}``).
:class:`Calls` turns those declarations into one :class:`Guard` per service, and every stage makes
its calls through its guard:

- **deadline**: :attr:`Guard.timeout_s` is what the stage gives its client (Redis socket timeout,
  Triton ``client_timeout``, the HTTP timeout); no call waits longer;
- **retries with jittered backoff** (tenacity's ``wait_random_exponential``): a failure of the
  service (the ``failures`` exception types the stage names: a refused connection, a timeout, a
  5xx) is tried again ``retries`` times; a record's own fault (a 4xx, a refused row) is not a
  failure of the service and is never retried here;
- **circuit breaker** (pybreaker) with the declared thresholds: ``failures`` consecutive failures
  open it; while it is open no call goes out at all, and after ``reset_s`` one trial call decides
  whether it closes again. Its state is the gauge ``tangram_calls_breaker_state`` (0 closed,
  1 half-open, 2 open), with ``tangram_calls_total{outcome}`` and a latency histogram.

When the tries are spent or the breaker is open the guard raises :class:`ServiceUnavailableError`,
a :class:`~streams.errors.BackpressureError` whose message ends with the service's own last failure (which
model version, which host, which status) and whose ``__cause__`` is that failure: the delivery loop (:mod:`streams.delivery`) puts the
batch back, pauses every partition and keeps polling (the group never rebalances), asks the
processor whether it is ``ready()`` — a guard answers from its breaker first, without a call, while
it is open — and resumes without loss. The longest a guarded call can block the loop is bounded
(:meth:`Guard.worst_case_s`); ``tangram plan`` refuses a declaration whose bound comes near
Kafka's ``max.poll.interval.ms``.

A service a processor calls without declaring it gets :data:`DEFAULT_CALLS`' policy for it (a
deadline, two retries, no breaker), so no call is ever unbounded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pybreaker
import redis
from prometheus_client import Counter, Gauge, Histogram
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from streams.errors import ServiceUnavailableError
from streams.topology import CircuitBreaker, ExternalCall

log = logging.getLogger("tangram.resilience")

T = TypeVar("T")

BREAKER_STATE = Gauge("tangram_calls_breaker_state",
                      "Circuit breaker of a processor's calls to a service: 0 closed, 1 half-open, 2 open.",
                      ["processor", "service"])
CALLS = Counter("tangram_calls_total", "Calls to a service, by outcome (ok, retried, failed, rejected: breaker open).",
                ["processor", "service", "outcome"])
CALL_SECONDS = Histogram("tangram_calls_duration_seconds", "One try of a call to a service, answered or not.",
                         ["processor", "service"],
                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

_STATE_VALUE = {pybreaker.STATE_CLOSED: 0, pybreaker.STATE_HALF_OPEN: 1, pybreaker.STATE_OPEN: 2}

#: The policy of a service a processor calls without declaring it: a deadline, two retries, no breaker.
DEFAULT_CALLS: dict[str, ExternalCall] = {
    "triton": ExternalCall(service="triton", timeout_ms=2000, retries=2),
    "redis": ExternalCall(service="redis", timeout_ms=5000, retries=2),
    "registry": ExternalCall(service="registry", timeout_ms=5000, retries=2),
    "http": ExternalCall(service="http", timeout_ms=5000, retries=2),
}
#: What a failed Redis call raises (refused, reset, timed out, loading): the service, not the data.
REDIS_FAILURES: tuple[type[BaseException], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
#: The first retry waits up to this long (jittered, doubling up to BACKOFF_MAX_S).
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 2.0


def worst_case_s(call: ExternalCall, backoff_initial_s: float = BACKOFF_INITIAL_S,
                 backoff_max_s: float = BACKOFF_MAX_S) -> float:
    """The longest one call under ``call``'s policy can block its stage: every try to its deadline, and the
    longest jittered wait between tries."""
    tries = call.retries + 1
    waits = sum(min(backoff_max_s, backoff_initial_s * 2 ** i) for i in range(tries - 1))
    return tries * call.timeout_ms / 1000 + waits


class _Exported(pybreaker.CircuitBreakerListener):
    """Keeps the breaker's gauge and log in step with its state."""

    def __init__(self, processor: str, service: str):
        self.processor, self.service = processor, service

    def state_change(self, cb: pybreaker.CircuitBreaker, old_state, new_state) -> None:  # noqa: ANN001 - pybreaker's
        BREAKER_STATE.labels(self.processor, self.service).set(_STATE_VALUE.get(new_state.name, 0))
        if old_state is not None and old_state.name != new_state.name:
            level = logging.WARNING if new_state.name == pybreaker.STATE_OPEN else logging.INFO
            log.log(level, "%s: circuit breaker of %s calls %s → %s", self.processor, self.service,
                    old_state.name, new_state.name)


class Guard:
    """Every call of one processor to one service: deadline, retries with jittered backoff, circuit breaker.

    ``failures``: the exception types that mean the service failed (retried, counted by the breaker);
    anything else a call raises passes through untouched (and counts as an answer for the breaker).
    """

    def __init__(self, processor: str, call: ExternalCall, failures: tuple[type[BaseException], ...], *,
                 backoff_initial_s: float = BACKOFF_INITIAL_S, backoff_max_s: float = BACKOFF_MAX_S,
                 sleep: Callable[[float], None] = time.sleep):
        self.processor = processor
        self.call_spec = call
        self.service = call.service
        self.failures = failures
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._sleep = sleep
        #: the service's newest failure (what the final error names, and chains, when the breaker hides it)
        self.last_failure: BaseException | None = None
        spec: CircuitBreaker | None = call.circuit_breaker
        self.breaker: pybreaker.CircuitBreaker | None = None
        self._storage = pybreaker.CircuitMemoryStorage(pybreaker.STATE_CLOSED)  # where it keeps when it opened
        if spec is not None:
            self.breaker = pybreaker.CircuitBreaker(
                fail_max=spec.failures, reset_timeout=spec.reset_s, name=f"{processor}:{call.service}",
                state_storage=self._storage,
                exclude=[lambda exc: not isinstance(exc, failures)], listeners=[_Exported(processor, call.service)])
        BREAKER_STATE.labels(processor, call.service).set(0)

    # -- what the stage reads --------------------------------------------------------------
    @property
    def timeout_s(self) -> float:
        """The deadline of one call: what the stage's client waits at most."""
        return self.call_spec.timeout_ms / 1000

    @property
    def tries(self) -> int:
        return self.call_spec.retries + 1

    @property
    def state(self) -> str:
        """``closed``, ``half-open`` or ``open`` (``closed`` without a declared breaker)."""
        if self.breaker is None:
            return pybreaker.STATE_CLOSED
        state = self.breaker.current_state
        if state == pybreaker.STATE_OPEN and self._reset_due():
            return pybreaker.STATE_HALF_OPEN  # the next call is the trial
        return state

    def available(self) -> bool:
        """False while the breaker is open and its ``reset_s`` has not passed: no call would go out."""
        return self.state != pybreaker.STATE_OPEN

    def worst_case_s(self) -> float:
        """The longest one guarded call can take: every try to its deadline, and the longest waits between."""
        return worst_case_s(self.call_spec, self.backoff_initial_s, self.backoff_max_s)

    # -- calls -------------------------------------------------------------------------------
    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``fn(*args, **kwargs)`` under the policy; :class:`ServiceUnavailableError` when the service failed."""
        self._check_open()
        retrying = Retrying(sleep=self._sleep, **self._retry_policy())
        try:
            for attempt in retrying:
                with attempt:
                    return self._once(fn, *args, **kwargs)
        except ServiceUnavailableError:
            raise
        except (pybreaker.CircuitBreakerError, *self.failures) as exc:
            error, cause = self._unavailable(exc)
            raise error from cause
        raise AssertionError("unreachable")  # pragma: no cover - Retrying either returns or raises

    async def acall(self, fn: Callable[..., Awaitable[T]], *args: object, **kwargs: object) -> T:
        """The same for a coroutine function (the inference worker's asyncio Triton client)."""
        self._check_open()
        retrying = AsyncRetrying(**self._retry_policy())
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._aonce(fn, *args, **kwargs)
        except ServiceUnavailableError:
            raise
        except (pybreaker.CircuitBreakerError, *self.failures) as exc:
            error, cause = self._unavailable(exc)
            raise error from cause
        raise AssertionError("unreachable")  # pragma: no cover

    def probe(self, fn: Callable[[], object]) -> bool:
        """A readiness check through the breaker, one try: False while open (no call), or when it fails.

        After ``reset_s`` this is the half-open trial call: its success closes the breaker."""
        if not self.available():
            return False
        try:
            self._once(fn)
            return True
        except (pybreaker.CircuitBreakerError, *self.failures) as exc:
            log.info("%s: %s still unavailable: %s", self.processor, self.service, exc)
            return False

    async def aprobe(self, fn: Callable[[], Awaitable[object]]) -> bool:
        if not self.available():
            return False
        try:
            await self._aonce(fn)
            return True
        except (pybreaker.CircuitBreakerError, *self.failures) as exc:
            log.info("%s: %s still unavailable: %s", self.processor, self.service, exc)
            return False

    # -- internals ----------------------------------------------------------------------------
    def _retry_policy(self) -> dict:
        def service_failed(exc: BaseException) -> bool:
            # a breaker that opened during the tries ends them: no call would go out anyway
            return isinstance(exc, self.failures) and self.available()

        def before_sleep(state: RetryCallState) -> None:
            CALLS.labels(self.processor, self.service, "retried").inc()
            log.warning("%s: %s call failed (try %d of %d), again in %.2fs: %s", self.processor, self.service,
                        state.attempt_number, self.tries, state.next_action.sleep if state.next_action else 0.0,
                        state.outcome.exception() if state.outcome else "?")

        return {"stop": stop_after_attempt(self.tries), "reraise": True,
                "wait": wait_random_exponential(multiplier=self.backoff_initial_s, max=self.backoff_max_s),
                "retry": retry_if_exception(service_failed), "before_sleep": before_sleep}

    def _once(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        started = time.perf_counter()
        try:
            if self.breaker is None:
                return fn(*args, **kwargs)
            with self.breaker.calling():
                return fn(*args, **kwargs)
        except self.failures as exc:
            self.last_failure = exc
            raise
        except pybreaker.CircuitBreakerError as exc:  # the failure that tripped it is its context
            self._note_tripped(exc)
            raise
        finally:
            CALL_SECONDS.labels(self.processor, self.service).observe(time.perf_counter() - started)

    async def _aonce(self, fn: Callable[..., Awaitable[T]], *args: object, **kwargs: object) -> T:
        started = time.perf_counter()
        try:
            if self.breaker is None:
                return await fn(*args, **kwargs)
            with self.breaker.calling():
                return await fn(*args, **kwargs)
        except self.failures as exc:
            self.last_failure = exc
            raise
        except pybreaker.CircuitBreakerError as exc:
            self._note_tripped(exc)
            raise
        finally:
            CALL_SECONDS.labels(self.processor, self.service).observe(time.perf_counter() - started)

    def _note_tripped(self, exc: pybreaker.CircuitBreakerError) -> None:
        context = exc.__cause__ or exc.__context__
        if isinstance(context, self.failures):
            self.last_failure = context

    def _check_open(self) -> None:
        if not self.available():
            CALLS.labels(self.processor, self.service, "rejected").inc()
            last = f"; last failure: {self.last_failure}" if self.last_failure is not None else ""
            error = ServiceUnavailableError(
                f"{self.processor}: {self.service} circuit breaker open after {self.breaker.fail_counter} failures; "
                f"next trial in {self._reset_left():.1f}s{last}", service=self.service)
            raise error from self.last_failure
        CALLS.labels(self.processor, self.service, "ok").inc(0)  # the series exists from the first call on

    def _unavailable(self, exc: BaseException) -> tuple[ServiceUnavailableError, BaseException]:
        """The final error of a call, and its cause: the service's own failure, also when the breaker tripped on it
        (pybreaker then raises its own error, which says nothing of what failed)."""
        CALLS.labels(self.processor, self.service, "failed").inc()
        cause = exc
        if isinstance(exc, pybreaker.CircuitBreakerError):
            context = exc.__cause__ or exc.__context__
            cause = context if isinstance(context, self.failures) else (self.last_failure or exc)
        detail = str(cause) if cause is exc else f"{cause} (then: {exc})"
        error = ServiceUnavailableError(f"{self.processor}: {self.service} unavailable "
                                        f"({self.tries} tries of {self.timeout_s:g}s, breaker {self.state}): {detail}",
                                        service=self.service)
        return error, cause

    def _reset_due(self) -> bool:
        return self._reset_left() <= 0

    def _reset_left(self) -> float:
        if self.breaker is None or self._storage.opened_at is None:
            return 0.0
        opened = self._storage.opened_at.timestamp()
        return opened + self.breaker.reset_timeout - time.time()


class Calls:
    """The guards of one processor, from its topology declaration (``calls:``)."""

    def __init__(self, processor: str, declared: list[ExternalCall]):
        self.processor = processor
        self.declared: dict[str, ExternalCall] = {}
        for call in declared:
            if call.service in self.declared:
                raise ValueError(f"processor {processor!r} declares its {call.service} calls twice")
            self.declared[call.service] = call
        self._guards: dict[str, Guard] = {}

    def spec(self, service: str) -> ExternalCall:
        """The declared policy of ``service``, or its default (:data:`DEFAULT_CALLS`)."""
        return self.declared.get(service) or DEFAULT_CALLS[service]

    def guard(self, service: str, failures: tuple[type[BaseException], ...], **kwargs: object) -> Guard:
        """The processor's guard of ``service`` (one per service: its calls share a breaker)."""
        guard = self._guards.get(service)
        if guard is None:
            guard = self._guards[service] = Guard(self.processor, self.spec(service), failures, **kwargs)
        return guard

    def guards(self) -> list[Guard]:
        return list(self._guards.values())

    def available(self) -> bool:
        """False while any of the processor's breakers is open: a batch would only be put back again."""
        return all(g.available() for g in self._guards.values())
