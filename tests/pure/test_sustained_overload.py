"""`x-should-retry: false` under a sustained overload (`fleet.policy.client_clock.sustained_overload`):
a retry that would be refused again within the caller's patience is not invited; a short burst
still is. The gateway's refusals and the simulator's callers ask the same `should_retry`."""

from __future__ import annotations

import inspect

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.policy.client_clock import should_retry, sustained_overload

retry_after = st.integers(min_value=1, max_value=60)
left = st.one_of(st.none(), st.integers(min_value=1, max_value=5))


def test_a_short_burst_is_invited_a_sustained_overload_is_not() -> None:
    # Retry-After 1 s, 2 retries left: the caller's patience is 2 s of the line's Retry-After.
    assert should_retry(retry_after_s=1, retryable=True, attempts_left=2, busy_s=0.5)
    assert should_retry(retry_after_s=1, retryable=True, attempts_left=2, busy_s=1.9)
    assert not should_retry(retry_after_s=1, retryable=True, attempts_left=2, busy_s=2.0)
    assert not should_retry(retry_after_s=1, retryable=True, attempts_left=1, busy_s=1.0)  # its last retry
    assert not should_retry(retry_after_s=3, retryable=True, attempts_left=None, busy_s=6.0)  # the SDK's 2 assumed
    assert should_retry(retry_after_s=3, retryable=True, attempts_left=None, busy_s=5.9)


def test_capacity_on_its_way_keeps_the_retry_invited() -> None:
    # A replica starting will drain the line faster than it has drained: the spell is no forecast.
    assert should_retry(retry_after_s=1, retryable=True, attempts_left=2, busy_s=10.0, starting=1)
    assert not should_retry(retry_after_s=1, retryable=True, attempts_left=2, busy_s=10.0, starting=0)


@settings(max_examples=300, deadline=None)
@given(retry_after, left, st.floats(min_value=0, max_value=600), st.integers(min_value=0, max_value=4))
def test_sustained_means_the_spell_has_outlasted_the_callers_patience(
    ra: int, n: int | None, busy: float, starting: int
) -> None:
    got = sustained_overload(retry_after_s=ra, busy_s=busy, attempts_left=n, starting=starting)
    assert got == (starting == 0 and busy > 0 and busy >= ra * (2 if n is None else n))
    # should_retry is the old rule and not `got`: the new rule only ever takes an invitation away.
    old = should_retry(retry_after_s=ra, retryable=True, attempts_left=n)
    assert old  # 1..60 s, retries left: invited before
    assert should_retry(retry_after_s=ra, retryable=True, attempts_left=n, busy_s=busy, starting=starting) == (not got)


@settings(max_examples=300, deadline=None)
@given(retry_after, left, st.floats(min_value=0, max_value=600), st.floats(min_value=0, max_value=600))
def test_a_longer_spell_never_turns_false_into_true(ra: int, n: int | None, a: float, b: float) -> None:
    short, long = sorted((a, b))
    if not should_retry(retry_after_s=ra, retryable=True, attempts_left=n, busy_s=short):
        assert not should_retry(retry_after_s=ra, retryable=True, attempts_left=n, busy_s=long)


@given(retry_after, left, st.floats(min_value=0, max_value=600))
def test_what_was_final_stays_final(ra: int, n: int | None, busy: float) -> None:
    assert not should_retry(retry_after_s=ra, retryable=False, attempts_left=n, busy_s=busy)
    assert not should_retry(retry_after_s=ra, retryable=True, attempts_left=0, busy_s=busy)
    assert not should_retry(retry_after_s=61, retryable=True, attempts_left=n, busy_s=busy)


def test_the_gateway_and_the_simulator_ask_the_same_rule() -> None:
    import gateway.tickets
    import simulator.clients

    for module in (gateway.tickets, simulator.clients):
        assert module.should_retry is should_retry
        assert "busy_s=" in inspect.getsource(module)
