"""The retry gate in Redis (`fleet.store.retries`, run at the head of admission's one script): a retry
takes over a parked call once, an Idempotency-Key with another body is told apart, and the retry
budget's Lua is the policy's rule (`fleet.policy.retries.retry_allowed`), on generated windows."""

from __future__ import annotations

import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.policy.retries import retry_allowed
from fleet.store.admitting import AdmissionSnapshot, Admitting, Attempt, Gated, RetryBudget
from fleet.store.line import Line
from fleet.store.retries import JOINED, OTHER_BODY, RETRY_BUDGET_SPENT, Retries


async def gate(line: Line, attempt: Attempt, budget: RetryBudget | None = None) -> AdmissionSnapshot | Gated:
    return await Admitting(line.redis).observe_and_mark(line.keys, line.prefix, f"1:{uuid.uuid4().hex}", 5000,
                                                        attempt=attempt, budget=budget or RetryBudget())


async def test_a_retry_takes_over_a_parked_call_once(line: Line) -> None:
    await Retries(line.redis).park(line.keys, "id1", "rid-1", "digest-a", 5000)
    got = await gate(line, Attempt("id1", "digest-a", retry=True, taken_ms=9000))
    assert got == Gated(JOINED, "rid-1")
    assert await Retries(line.redis).state(line.keys, "id1", "rid-1") == "taken"
    assert 5000 < await line.redis.pttl(line.keys.retry("id1")) <= 9000  # held for the retry's deadline
    # Taken: a second attempt of the same identity is a call of its own, not a second reader.
    assert isinstance(await gate(line, Attempt("id1", "digest-a", retry=True)), AdmissionSnapshot)


async def test_an_idempotency_key_with_another_body_is_told_apart(line: Line) -> None:
    await Retries(line.redis).park(line.keys, "idem", "rid-2", "digest-a", 5000)
    assert await gate(line, Attempt("idem", "digest-b")) == Gated(OTHER_BODY)
    assert await Retries(line.redis).state(line.keys, "idem", "rid-2") == "parked"  # still there for its retry


async def test_a_park_gone_is_nobodys(line: Line) -> None:
    await Retries(line.redis).park(line.keys, "gone", "rid-3", "d", 1)
    await line.redis.delete(line.keys.retry("gone"))  # as its TTL does
    assert await Retries(line.redis).state(line.keys, "gone", "rid-3") is None
    assert isinstance(await gate(line, Attempt("gone", "d", retry=True)), AdmissionSnapshot)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(firsts=st.integers(0, 200), retries=st.integers(0, 60), ratio=st.sampled_from([0.0, 0.1, 0.2, 0.5, 1.0]),
       window_s=st.integers(1, 30), min_per_s=st.sampled_from([0.0, 0.3, 1.0, 3.0]))
async def test_the_budgets_lua_is_the_policys_rule(line: Line, firsts: int, retries: int, ratio: float,
                                                   window_s: int, min_per_s: float) -> None:
    await line.redis.delete(line.keys.retry_window)
    now_s = int((await line.redis.time())[0])
    await line.redis.hset(line.keys.retry_window, mapping={f"f{now_s}": firsts, f"r{now_s}": retries})
    got = await gate(line, Attempt(retry=True), RetryBudget(ratio, window_s, min_per_s))
    allowed = retry_allowed(firsts, retries, ratio=ratio, window_s=window_s, min_per_s=min_per_s)
    assert (got != Gated(RETRY_BUDGET_SPENT)) == allowed
