"""The Responses API's stored state in Redis: only the key that made a response can read, continue
or delete it (another key gets a 404, as if it never was); the store's bounds refuse a turn with a
typed 400 before it runs; a response lives `responses.ttl_s` (30 days by default); the continued
conversation's tokens count as the call's input; and a conversation continues on another gateway
process on a Redis Cluster. (A bad bound in the config: tests/pure/test_responses_bounds.py.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.harness import TEST_CONFIG, Fleet

ALICE, BOB = "sk-alice-responses-test", "sk-bob-responses-test"
MAX_RESPONSE, MAX_CONVERSATION = 2000, 5000


def _config(out: Path) -> Path:
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["keys"] = [{"name": name, "sha256": hashlib.sha256(secret.encode()).hexdigest()}
                   for name, secret in (("alice", ALICE), ("bob", BOB))]
    cfg["responses"] = {"max_response_bytes": MAX_RESPONSE, "max_conversation_bytes": MAX_CONVERSATION}
    path = out / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def keyed(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(redis_url, config_path=_config(tmp_path_factory.mktemp("responses-keys")))
    try:
        f.start_gateway()
        f.start_worker("routing")
        yield f
    finally:
        f.stop()


def client(f: Fleet, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{f.base_url}/v1", api_key=key, max_retries=0)


def _status(call: object) -> tuple[int, str | None, str | None]:
    try:
        call()  # type: ignore[operator]
    except openai.APIStatusError as e:
        return e.status_code, e.body["code"], e.body["param"]
    raise AssertionError("the call was not refused")


def test_another_key_cannot_read_continue_or_delete(keyed: Fleet) -> None:
    alice, bob = client(keyed, ALICE), client(keyed, BOB)
    r = alice.responses.create(model="routing", input="secret plan", max_output_tokens=4)
    assert _status(lambda: bob.responses.retrieve(r.id)) == (404, "response_not_found", None)
    assert _status(lambda: bob.responses.create(model="routing", previous_response_id=r.id, input="more")) == (
        404, "response_not_found", "previous_response_id")
    assert _status(lambda: bob.responses.delete(r.id)) == (404, "response_not_found", None)
    # An id that never existed reads the same to bob: nothing to tell the two apart.
    assert _status(lambda: bob.responses.retrieve("resp_" + "1" * 48)) == (404, "response_not_found", None)
    assert alice.responses.retrieve(r.id).output_text == r.output_text  # untouched by bob's tries
    assert alice.responses.create(model="routing", previous_response_id=r.id, input="more",
                                  max_output_tokens=4).previous_response_id == r.id


def test_a_turn_past_the_bounds_is_refused_before_it_runs(keyed: Fleet) -> None:
    alice = client(keyed, ALICE)
    accepted = keyed.counters("routing").get("accepted", 0)
    assert _status(lambda: alice.responses.create(model="routing", input="x" * MAX_RESPONSE)) == (
        400, "response_too_large", "input")
    # Not stored, not bounded: the same input with store false runs.
    assert alice.responses.create(model="routing", input="x" * MAX_RESPONSE, store=False, max_output_tokens=2).id
    prev, grown = None, 0
    for _ in range(10):  # turns of ~1.2 KB until the conversation would pass 5 KB
        try:
            r = alice.responses.create(model="routing", input="y" * 1200, previous_response_id=prev,
                                       max_output_tokens=2)
        except openai.BadRequestError as e:
            assert (e.body["code"], e.body["param"]) == ("conversation_too_large", "previous_response_id")
            assert "responses.max_conversation_bytes" in e.body["message"]
            break
        prev, grown = r.id, grown + 1
    else:
        raise AssertionError("the conversation grew past its bound")
    assert grown == 3  # 3 turns of ~1.2 KB fit in 5 KB, a 4th does not
    # The refused calls never reached the line: only the store-false call and the turns that fit did.
    assert keyed.counters("routing").get("accepted", 0) == accepted + 1 + grown


def test_an_answer_that_passes_the_bound_is_kept_without_its_conversation(keyed: Fleet) -> None:
    """The input fits, the output pushes the turn past max_response_bytes: the caller still gets
    its answer (its tokens were spent), the response can be read, and continuing it is a typed 400
    that says why, not a 404 that pretends it never was."""
    alice = client(keyed, ALICE)
    r = alice.responses.create(model="routing", input="z" * (MAX_RESPONSE - 150), max_output_tokens=60,
                               extra_body={"ignore_eos": True})  # all 60 tokens: what passes the bound
    assert r.output_text and r.usage is not None and r.usage.output_tokens == 60
    assert alice.responses.retrieve(r.id).output_text == r.output_text
    assert _status(lambda: alice.responses.create(model="routing", previous_response_id=r.id, input="more")) == (
        400, "conversation_too_large", "previous_response_id")


def test_ttl_and_the_continued_conversation_counted_as_input(keyed: Fleet) -> None:
    alice = client(keyed, ALICE)
    first = alice.responses.create(model="routing", input="count me " * 20, max_output_tokens=4)
    ttl = keyed.r.ttl(f"{keyed.namespace}:resp:{first.id}")
    assert 30 * 86_400 - 60 < ttl <= 30 * 86_400  # the default: OpenAI's 30 days
    before = keyed.counters("routing").get("prompt_tokens", 0)
    second = alice.responses.create(model="routing", input="and this", previous_response_id=first.id,
                                    max_output_tokens=4)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the history is the call's input
    assert keyed.counters("routing").get("prompt_tokens", 0) - before == second.usage.input_tokens


def test_continued_on_another_gateway_on_a_cluster(redis_cluster_url: str) -> None:
    a = Fleet(redis_cluster_url)
    b = Fleet(redis_cluster_url, namespace=a.namespace)
    try:
        a.start_gateway()
        a.start_worker("routing")
        b.start_gateway()
        tools = [{"type": "function", "name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
        first = client(a, "unused").responses.create(model="routing", input="Weather?", tools=tools)
        [call] = [o for o in first.output if o.type == "function_call"]
        second = client(b, "unused").responses.create(model="routing", tools=tools, previous_response_id=first.id,
                                                      input=[{"type": "function_call_output",
                                                              "call_id": call.call_id, "output": "sunny"}])
        assert "sunny" in second.output_text
        assert client(a, "unused").responses.retrieve(second.id).output_text == second.output_text
    finally:
        b.stop()
        a.stop()
