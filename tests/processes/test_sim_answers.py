"""The `sim` engine's plain answers end as a model's do, through a live fleet on the shipped
configs/fleet.yaml (what `make up` runs; only the sim's model load is skipped, and its clock runs
four times faster: the lengths are the shipped profile's), with the real `openai` client.

Before issue 35 a plain answer was always `max_tokens` words ending `length`: the SDK's
`responses.create` came back `incomplete` even with `max_output_tokens=256`, `responses.stream`
raised "Didn't receive a `response.completed` event", a continued conversation was incomplete
at every turn, and every plain chat answer ended `length` (which Instructor treats as an error).
Now an answer's length is drawn from the tier's sim profile, per request and reproducibly; it ends
`stop`, is cut (`length`, `incomplete`) only when the bound is shorter, and vLLM's `ignore_eos`
writes exactly the bound.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from fleet.config import DEFAULT_CONFIG
from tests.harness import Fleet

TIERS = ("routing", "analysis")  # the planner's answers take seconds each on its shipped decode step


@pytest.fixture(scope="module")
def shipped(redis_url: str) -> Iterator[Fleet]:
    """A gateway and one replica of each tier on the shipped config, its model load skipped."""
    skip = {f"FLEET_TIERS__{t.upper()}__SIM__{k}": "0" for t in TIERS for k in ("WEIGHTS_GB", "WARMUP_S")}
    f = Fleet(redis_url, config_path=DEFAULT_CONFIG, env_overrides=skip)
    try:
        f.start_gateway()
        for tier in TIERS:
            f.start_worker(tier, time_scale="0.25")
        yield f
    finally:
        f.stop()


def client(f: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("tier", TIERS)
def test_responses_create_stream_and_a_continued_conversation_complete(shipped: Fleet, tier: str) -> None:
    c = client(shipped)
    r = c.responses.create(model=tier, input="What is today's thesis?", max_output_tokens=256)
    assert (r.status, r.incomplete_details) == ("completed", None), r
    assert r.output_text and r.usage is not None and 0 < r.usage.output_tokens < 256
    with c.responses.stream(model=tier, input="Summarise the tape.") as s:  # no bound: the tier's default
        kinds = [e.type for e in s]
        final = s.get_final_response()  # raises when the stream did not end `response.completed`
    assert kinds[-1] == "response.completed" and final.status == "completed" and final.output_text
    prev = r.id
    for question in ("And the risks?", "Which assets?"):
        turn = c.responses.create(model=tier, input=question, previous_response_id=prev)
        assert turn.status == "completed" and turn.previous_response_id == prev and turn.output_text, turn
        prev = turn.id


def test_responses_incomplete_only_when_max_output_tokens_cuts(shipped: Fleet) -> None:
    c = client(shipped)
    whole = c.responses.create(model="routing", input="Route this order.", max_output_tokens=1000)
    assert whole.status == "completed" and whole.usage is not None
    n = whole.usage.output_tokens
    if n > 1:  # the same request with a bound one short of its answer
        cut = c.responses.create(model="routing", input="Route this order.", max_output_tokens=n - 1)
        assert cut.status == "incomplete" and cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens" and cut.usage is not None
        assert cut.usage.output_tokens == n - 1
    exact = c.responses.create(model="routing", input="Route this order.", max_output_tokens=300,
                               extra_body={"ignore_eos": True})
    assert exact.status == "incomplete" and exact.usage is not None and exact.usage.output_tokens == 300


def test_a_plain_chat_answer_stops_of_its_own_accord_and_ignore_eos_runs_to_max_tokens(shipped: Fleet) -> None:
    c = client(shipped)
    ask = [{"role": "user", "content": "Classify: AAPL beats on revenue."}]
    r = c.chat.completions.create(model="routing", messages=ask, max_tokens=1000)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "stop" and r.usage is not None
    n = r.usage.completion_tokens
    assert 0 < n < 1000 and len((r.choices[0].message.content or "").split()) == n
    # The same request, streamed: the same length (drawn from the request, not from chance).
    chunks = list(c.chat.completions.create(model="routing", messages=ask, max_tokens=1000, stream=True,  # type: ignore[arg-type]
                                            stream_options={"include_usage": True}))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == n
    if n > 1:  # a bound shorter than the answer cuts it
        short = c.chat.completions.create(model="routing", messages=ask, max_tokens=n - 1)  # type: ignore[arg-type]
        assert short.choices[0].finish_reason == "length" and short.usage is not None
        assert short.usage.completion_tokens == n - 1
    # vLLM's ignore_eos: exactly max_tokens, what benchmarks send for a fixed length.
    exact = c.chat.completions.create(model="routing", messages=ask, max_tokens=200,  # type: ignore[arg-type]
                                      extra_body={"ignore_eos": True})
    assert exact.choices[0].finish_reason == "length" and exact.usage is not None
    assert exact.usage.completion_tokens == 200
    # Per call: other requests draw other lengths, around the tier's typical answer (20 on routing).
    lengths = {c.chat.completions.create(model="routing", max_tokens=1000, messages=[  # type: ignore[arg-type,union-attr]
        {"role": "user", "content": f"Classify asset {i}."}]).usage.completion_tokens for i in range(8)}
    assert len(lengths) >= 3 and max(lengths) < 1000, lengths
