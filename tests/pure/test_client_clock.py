"""The caller's clock and the retry rules as pure functions: the deadline a call gets, the patience
across its retries, what its refusal tells the SDK, who an attempt is, and invariant 8."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.config import Priority
from fleet.policy import ObservedReplica, Replicas, admission_forecast, observe_tier
from fleet.policy.admission import ServiceForecast, admit, queue_wait_s
from fleet.policy.client_clock import call_clock, patience_s, should_retry
from fleet.policy.retries import call_identity, retry_allowed
from fleet.policy.tier_capacity import TierCapacity

CLOCK = {"default_ms": 120_000, "max_ms": 86_400_000, "sdk_retries": 2}


def test_the_header_wins_over_the_sdks_timeout() -> None:
    c = call_clock(header_ms=5000, timeout_s=60.0, retry_count=0, stream=False, joined=True, **CLOCK)
    assert (c.deadline_ms, c.source, c.judged_ms) == (5000, "header", 5000)


def test_no_header_and_no_sdk_is_the_default() -> None:
    c = call_clock(header_ms=None, timeout_s=None, retry_count=None, stream=False, joined=True, **CLOCK)
    assert (c.deadline_ms, c.source, c.attempts_left) == (120_000, "default", None)


def test_a_whole_answer_is_judged_on_one_attempt_and_may_run_across_the_retries() -> None:
    # 5 s a try; first attempt of 3: admission judges it on this attempt's 5 s (a little short of
    # it: the answer must be back before the timeout fires), and a call no attempt alone can
    # see on the 15 s its retries joining it give; it may run that long.
    joined = call_clock(header_ms=None, timeout_s=5.0, retry_count=0, stream=False, joined=True, **CLOCK)
    assert (joined.deadline_ms, joined.source, joined.attempts_left) == (15_000, "client", 2)
    assert 4_700 <= joined.judged_ms < 5_000 and joined.patience_ms is not None
    assert 14_000 <= joined.patience_ms < 15_000
    last = call_clock(header_ms=None, timeout_s=5.0, retry_count=2, stream=False, joined=True, **CLOCK)
    assert last.deadline_ms == 5000 and last.attempts_left == 0 and last.retry
    alone = call_clock(header_ms=None, timeout_s=5.0, retry_count=0, stream=False, joined=False, **CLOCK)
    assert alone.deadline_ms == 5000


def test_a_stream_on_the_sdks_clock_bounds_its_first_chunk_not_its_end() -> None:
    c = call_clock(header_ms=None, timeout_s=2.0, retry_count=0, stream=True, joined=True, **CLOCK)
    assert c.first_token and c.judged_ms < 2000 and c.deadline_ms == 120_000


def test_patience_counts_retries_only_when_they_join() -> None:
    assert patience_s(4.0, 2, joined=True) == 12.0 and patience_s(4.0, 2, joined=False) == 4.0


def test_should_retry_says_no_to_what_no_retry_can_turn_around() -> None:
    assert should_retry(retry_after_s=2, retryable=True, attempts_left=1)
    assert should_retry(retry_after_s=2, retryable=True, attempts_left=None)
    assert not should_retry(retry_after_s=2, retryable=False, attempts_left=2)  # a spent budget
    assert not should_retry(retry_after_s=2, retryable=True, attempts_left=0)  # its last attempt
    assert not should_retry(retry_after_s=120, retryable=True, attempts_left=2)  # past what the SDK honours


def test_an_attempt_is_its_key_and_its_body_or_its_idempotency_key() -> None:
    a, da = call_identity("agent", b'{"x":1}')
    assert call_identity("agent", b'{"x":1}') == (a, da)
    assert call_identity("other", b'{"x":1}')[0] != a  # another key's same body is another call
    assert call_identity("agent", b'{"x":2}')[0] != a
    k1, d1 = call_identity("agent", b'{"x":1}', "order-7")
    k2, d2 = call_identity("agent", b'{"x":2}', "order-7")
    assert k1 == k2 and d1 != d2  # one call by its key; the digest tells its bodies apart


def test_the_retry_budget_is_a_share_of_first_attempts_with_a_floor() -> None:
    budget = {"ratio": 0.2, "window_s": 10, "min_per_s": 0.3}
    assert retry_allowed(0, 2, **budget) and not retry_allowed(0, 3, **budget)  # the floor: 3 in 10 s
    assert retry_allowed(100, 19, **budget) and not retry_allowed(100, 20, **budget)  # 20% of 100


def test_free_slots_start_at_once_and_the_rest_wait_for_a_completion() -> None:
    f = ServiceForecast(rate=2.0, delay_s=0.0, basis="model", free=2)
    assert queue_wait_s(0, f) == 0 and queue_wait_s(1, f) == 0
    assert queue_wait_s(2, f) == 0.5  # the next completion frees a slot for it
    assert queue_wait_s(3, ServiceForecast(rate=2.0, delay_s=0.0, basis="model")) == 1.5  # unknown: a fluid


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(1, 64), busy=st.integers(0, 63), admitting=st.integers(0, 64),
       step=st.floats(0.001, 0.1), tokens=st.integers(1, 2000), prompt=st.integers(0, 20_000),
       priority=st.sampled_from(list(Priority)), slack=st.floats(0.0, 5.0), limit=st.floats(0.0, 60.0))
def test_invariant_8_a_call_with_a_free_slot_and_an_empty_line_is_admitted(
        slots: int, busy: int, admitting: int, step: float, tokens: int, prompt: int, priority: Priority,
        slack: float, limit: float) -> None:
    # Whatever the tier, the calls being admitted beside it, and the class: while a free slot is
    # left for it, a call whose own service fits its deadline is admitted.
    busy = min(busy, slots - 1)
    admitting = min(admitting, slots - busy - 1)  # those being admitted take free slots before it
    cap = TierCapacity(slots=slots, startup_s=30.0, prefill_tokens_per_s=5000.0, decode_base_s=step,
                       decode_per_seq_s=0.0, kv_capacity_tokens=10**9, typical_prompt_tokens=prompt,
                       typical_output_tokens=tokens, max_tokens_default=tokens)
    line = [0, 0, 0, 0]
    line[priority] = admitting
    obs = observe_tier("t", 1000.0, 10.0, line=line, in_flight=busy,
                       replicas=Replicas.of([ObservedReplica("r", "ready", slots, busy, 0.0)]))
    forecast = admission_forecast(obs, cap)
    service = cap.service_s(prompt, tokens)
    d = admit(priority, ahead=sum(line[: priority + 1]), forecast=forecast, service_s=service,
              wait_limit_s=limit, deadline_s=service + slack)
    assert d.admitted, d.message


def test_a_call_no_attempt_alone_can_see_is_judged_on_the_patience_its_retries_give() -> None:
    cap = TierCapacity(slots=4, startup_s=0.0, prefill_tokens_per_s=1e9, decode_base_s=0.01, decode_per_seq_s=0.0,
                       kv_capacity_tokens=10**9, typical_prompt_tokens=10, typical_output_tokens=100,
                       max_tokens_default=100)
    obs = observe_tier("t", 1000.0, 10.0, replicas=Replicas.of([ObservedReplica("r", "ready", 4, 0, 0.0)]))
    tc_limit = 30.0
    from fleet.policy import AdmissionInput, judge_admission

    def judge(tokens: int) -> bool:
        q = AdmissionInput(obs, cap, Priority.interactive, 10, tokens, tc_limit, 2.4, first_token=False,
                           patience_s=7.2)
        return judge_admission(q).admitted

    assert judge(200)  # 2 s: fits one attempt
    assert judge(400)  # 4 s: fits no attempt, fits the three (their retries join it)
    assert not judge(800)  # 8 s: fits neither


def test_when_a_class_must_be_shed_a_new_chain_goes_before_a_chain_under_way() -> None:
    from fleet.policy import AdmissionInput, judge_admission

    cap = TierCapacity(slots=4, startup_s=0.0, prefill_tokens_per_s=1e9, decode_base_s=0.01, decode_per_seq_s=0.0,
                       kv_capacity_tokens=10**9, typical_prompt_tokens=10, typical_output_tokens=100,
                       max_tokens_default=100)
    # A full replica and 8 waiting: about 3 s in line, 1 s of service, against a 5 s deadline.
    obs = observe_tier("t", 1000.0, 10.0, line=(0, 8, 0, 0), in_flight=4,
                       replicas=Replicas.of([ObservedReplica("r", "ready", 4, 4, 0.0)]))

    def judge(opens_chain: bool) -> bool:
        q = AdmissionInput(obs, cap, Priority.interactive, 10, 100, 30.0, 5.0, opens_chain=opens_chain)
        return judge_admission(q).admitted

    assert judge(False) and not judge(True)
