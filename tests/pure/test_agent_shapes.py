"""The agent surface's pure pieces, without Redis: a call read into what the fleet needs of it, its
payload and result-event records, streamed deltas merged, the prompt estimate, and the sim's
answers to tools and schemas."""

from __future__ import annotations

import jsonschema
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.chat_shapes import merge_delta, merge_logprobs, message_of
from fleet.config import SimProfile, load_config
from fleet.prompt_size import PART_TOKENS, estimate_prompt_tokens
from fleet.store.events import EXPIRED_IN_LINE, Chunk, Done, Failed, chunk_fields, decode, encode, lua_literal
from fleet.store.payloads import BadPayload, CallPayload
from gateway.call_spec import parse_call
from gateway.errors import APIError
from tests.harness import TEST_CONFIG
from workers.engines.base import EngineError, EngineRequest
from workers.engines.sim_answers import answer, instance, natural_length

CFG = load_config(TEST_CONFIG)
TOOL = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 3}, "b": {"type": "string", "maxLength": 2}},
    "required": ["a", "b"], "additionalProperties": False}}}


def test_a_call_is_read_and_its_payload_carries_the_body_as_sent() -> None:
    raw = b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "tools": [' + orjson.dumps(TOOL) \
        + b'], "guided_json": {"x": 1.50}, "stream": true}'
    call = parse_call("chat", raw, orjson.loads(raw), CFG)
    assert (call.tier, call.stream, call.explicit_max_tokens) == ("routing", True, None)
    assert call.max_tokens > 0 and call.prompt_tokens > estimate_prompt_tokens("chat", {"messages": [
        {"role": "user", "content": "hi"}]})  # the tool schema counts
    payload = call.payload("key-1")
    assert raw in payload  # byte for byte: `1.50` and the spaces as the caller wrote them
    back = CallPayload.decode(payload)
    assert (back.kind, back.key, back.stream, back.max_tokens) == ("chat", "key-1", True, call.max_tokens)
    assert back.body["tools"] == [TOOL] and back.body["guided_json"] == {"x": 1.5}


def test_bad_calls_are_typed() -> None:
    with pytest.raises(APIError) as e:
        parse_call("chat", b"", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, CFG)
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    with pytest.raises(APIError) as e:
        parse_call("chat", b"", {"model": "small", "messages": [{"role": "user", "content": "x"}],
                                 "tools": [{"type": "function", "function": {"name": 3}}]}, CFG)
    assert (e.value.status, e.value.param) == (422, "tools.0.function.name")
    with pytest.raises(BadPayload):
        CallPayload.decode(b'{"n": 1}')


def test_result_events_round_trip_and_the_scripts_write_the_same_record() -> None:
    done = Done(2, "tool_calls", {"prompt_tokens": 5, "completion_tokens": 3, "details": {"x": 1}}, ttft_s=0.1,
                choice={"message": {"role": "assistant", "content": None}}, model="m")
    field, value = encode(done)
    assert decode({field: value}) == done and done.completion_tokens == 3
    failed = Failed(400, "invalid_request_error", "no", "bad", "messages[0]")
    assert decode(dict([encode(failed)])) == failed
    assert decode(chunk_fields(b'"text":"a"', "m")) == Chunk(b'"text":"a"', "m")
    assert Chunk(b'"delta":{"content":"a"},"logprobs":null').members() == {"delta": {"content": "a"},
                                                                             "logprobs": None}
    literal = lua_literal(EXPIRED_IN_LINE)
    assert decode({b"f": literal[4:-4].encode()}) == EXPIRED_IN_LINE and decode({b"w": b"1"}) is None


def test_tool_call_fragments_merge_by_index_as_clients_merge_them() -> None:
    merged: dict = {}
    opening = [{"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}}]
    second = [{"index": 1, "id": "c1", "type": "function", "function": {"name": "g", "arguments": "{"}}]
    for d in ({"role": "assistant", "content": None}, {"tool_calls": opening}, {"tool_calls": second},
              {"tool_calls": [{"index": 0, "function": {"name": None, "arguments": '{"a":'}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
              {"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]},
              {"reasoning_content": "think"}, {"reasoning_content": "ing"}):
        merge_delta(merged, d)
    msg = message_of(merged)
    assert msg["content"] is None and msg["reasoning_content"] == "thinking"
    assert msg["tool_calls"] == [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
                                 {"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    lp = merge_logprobs(None, {"content": [{"token": "a"}], "refusal": None})
    assert merge_logprobs(lp, {"content": [{"token": "b"}]}) == {"content": [{"token": "a"}, {"token": "b"}],
                                                                  "refusal": None}


def test_the_estimate_counts_tools_response_format_and_parts() -> None:
    plain = {"messages": [{"role": "user", "content": "x" * 400}]}
    assert estimate_prompt_tokens("chat", plain) == 102
    assert estimate_prompt_tokens("chat", {**plain, "tools": [TOOL]}) > 102 + len(orjson.dumps([TOOL])) // 4 - 1
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 40},
                                                        {"type": "image_url", "image_url": {"url": "data:" * 1000}}]}]}
    assert estimate_prompt_tokens("chat", image) == (3 + 4 + 40 + 3) // 4 + PART_TOKENS
    assert estimate_prompt_tokens("completion", {"prompt": ["abcd" * 10]}) == 10


def test_the_sim_calls_tools_with_arguments_that_fit_their_schema() -> None:
    req = EngineRequest.build("r1", "chat", messages=[{"role": "user", "content": "go"}], max_tokens=64, tools=[TOOL])
    plan = answer(req)
    merged: dict = {}
    for p in plan.pieces:
        merge_delta(merged, p.fields or {})
    [call] = message_of(merged)["tool_calls"]
    args = orjson.loads(call["function"]["arguments"])
    jsonschema.validate(args, TOOL["function"]["parameters"])
    assert plan.finish_reason == "tool_calls" and args == {"a": 3, "b": "si"}
    short = answer(EngineRequest.build("r1", "chat", messages=[{"role": "user", "content": "go"}], max_tokens=3,
                                       tools=[TOOL]))
    assert len(short.pieces) == 3 and short.finish_reason == "length"  # cut at max_tokens, as a model is
    with pytest.raises(EngineError) as e:
        answer(EngineRequest.build("r2", "chat", messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]))
    assert e.value.param == "messages[0].content[0]" and e.value.type == "invalid_request_error"


def _plain(rid: str, content: str, max_tokens: int, **fields: object) -> EngineRequest:
    return EngineRequest.build(rid, "chat", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                               **fields)


def test_a_plain_answer_ends_of_its_own_accord_at_a_length_the_request_draws() -> None:
    """As a model's: finish `stop` at a length drawn from the profile by the request (the same for its
    retry, another id, or a larger bound); `length` only when max_tokens is shorter; `ignore_eos`
    writes exactly max_tokens, as vLLM does."""
    profile = SimProfile(typical_output_tokens=40)
    first = answer(_plain("r1", "thesis?", 4096), profile)
    n = len(first.pieces)
    assert first.finish_reason == "stop" and 1 <= n < 4096
    again = answer(_plain("r1-2", "thesis?", 2000, stream=True), profile)  # a retry, another bound, streamed
    assert (len(again.pieces), again.finish_reason) == (n, "stop")
    assert answer(_plain("r1", "thesis?", n), profile).finish_reason == "stop"  # a bound it just fits
    if n > 1:
        cut = answer(_plain("r1", "thesis?", n - 1), profile)
        assert (len(cut.pieces), cut.finish_reason) == (n - 1, "length")
    eos = answer(_plain("r1", "thesis?", 300, ignore_eos=True), profile)
    assert (len(eos.pieces), eos.finish_reason) == (300, "length")
    steady = SimProfile(typical_output_tokens=40, output_tokens_spread=0)
    assert len(answer(_plain("r1", "thesis?", 4096), steady).pieces) == 40


def test_plain_answers_vary_around_the_typical_length() -> None:
    """Over many requests the lengths spread (log-normal) with the profile's typical length as mean."""
    profile = SimProfile(typical_output_tokens=120)
    lengths = [natural_length(_plain(f"r{i}", f"asset {i}", 4096), profile) for i in range(2000)]
    assert 0.9 * 120 < sum(lengths) / len(lengths) < 1.1 * 120
    assert min(lengths) < 60 and max(lengths) > 240 and len(set(lengths)) > 100


json_schemas = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer", "minimum": -5, "maximum": 5}, {"type": "number"},
                     {"type": "boolean"}, {"type": "null"}, {"enum": ["a", 1]}, {"const": 4},
                     {"type": "string", "format": "date-time"}, {"type": "string", "minLength": 6, "maxLength": 9}]),
    lambda inner: st.one_of(
        st.builds(lambda props: {"type": "object", "properties": props, "required": list(props),
                                 "additionalProperties": False},
                  st.dictionaries(st.text("abcdef", min_size=1, max_size=4), inner, max_size=4)),
        st.builds(lambda items, n: {"type": "array", "items": items, "minItems": n}, inner, st.integers(0, 3)),
        st.builds(lambda a: {"anyOf": [a, {"type": "null"}]}, inner)),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(json_schemas)
def test_a_sim_value_fits_any_schema_of_these_shapes(schema: dict) -> None:
    jsonschema.validate(instance(schema), schema)
