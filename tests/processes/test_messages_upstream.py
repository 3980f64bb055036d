"""The `openai` engine before an upstream that speaks Anthropic's Messages API (`upstream_api:
messages`): the real `anthropic` SDK through the fleet, whole and streamed, a tool_use round trip;
the upstream is called on `/v1/messages` with the caller's body, never on chat completions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
import yaml

from fleet.config import ConfigError, load_config
from tests.harness import Fleet
from tests.messages_upstream import GREETING, MODEL, TOOL_INPUT, MessagesUpstream, messages_config, running

TOOLS: list[Any] = [{"name": "weather", "description": "The forecast.",
                     "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                                       "days": {"type": "integer"}}}}]


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, MessagesUpstream]]:
    with running() as up:
        f = Fleet(redis_url, config_path=messages_config(tmp_path_factory.mktemp("msgup"), up))
        try:
            f.start_gateway()
            f.start_worker("analysis")
            yield f, up
        finally:
            f.stop()


def client(f: Fleet) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f.base_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_message_goes_to_the_upstreams_messages_route(fleet: tuple[Fleet, MessagesUpstream], streamed: bool) -> None:
    f, up = fleet
    up.seen.clear()
    system: Any = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    kw: dict[str, Any] = dict(model="analysis", max_tokens=64, system=system,
                              messages=[{"role": "user", "content": "hi"}])
    if streamed:
        with client(f).messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            msg = s.get_final_message()
        assert text.strip() == GREETING
    else:
        msg = client(f).messages.create(**kw)
    assert msg.content[0].type == "text" and msg.content[0].text.strip() == GREETING
    assert msg.stop_reason == "end_turn" and msg.usage.input_tokens == 21 and msg.usage.output_tokens == 7
    assert [p for p, _, _ in up.seen] == ["/v1/messages"]
    _, body, headers = up.seen[0]
    assert body["system"] == system and body["model"] == MODEL and body["stream"] is streamed  # the body, whole
    assert headers.get("anthropic-version")


@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_use_round_trip(fleet: tuple[Fleet, MessagesUpstream], streamed: bool) -> None:
    f, up = fleet
    up.seen.clear()
    c = client(f)
    turns: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    if streamed:
        with c.messages.stream(model="analysis", max_tokens=64, tools=TOOLS, messages=turns) as s:
            first = s.get_final_message()
    else:
        first = c.messages.create(model="analysis", max_tokens=64, tools=TOOLS, messages=turns)
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "weather" and use.input == TOOL_INPUT
    turns += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    second = c.messages.create(model="analysis", max_tokens=64, tools=TOOLS, messages=turns)
    assert second.content[0].type == "text" and second.content[0].text == "The tool said: sunny"
    assert [p for p, _, _ in up.seen] == ["/v1/messages", "/v1/messages"]
    assert up.seen[1][1]["messages"][1]["content"][0]["type"] == "tool_use"  # the caller's blocks, as sent
    assert up.seen[0][1]["tools"] == TOOLS


def test_upstream_api_is_validated(tmp_path: Any) -> None:
    from tests.harness import TEST_CONFIG
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["tiers"]["analysis"].update(engine="openai", openai={"upstream_api": "anthropic"})
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="upstream_api"):
        load_config(path)


def test_a_chat_caller_cannot_send_a_body_to_the_messages_upstream(fleet: tuple[Fleet, MessagesUpstream]) -> None:
    """The field that carries an Anthropic body to a Messages upstream is the fleet's own: a chat
    caller that sets it (openai's `extra_body`) is refused, naming it, and the upstream sees nothing."""
    import openai

    f, up = fleet
    up.seen.clear()
    chat = openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", max_retries=0)
    smuggled = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "ignore the fleet"}]}
    with pytest.raises(openai.BadRequestError) as e:
        chat.chat.completions.create(model="analysis", messages=[{"role": "user", "content": "hi"}],
                                     extra_body={"x_fleet_anthropic_body": smuggled})
    assert e.value.status_code == 400 and (e.value.body or {}).get("param") == "x_fleet_anthropic_body", e.value.body
    assert up.seen == []


@pytest.mark.parametrize("streamed", [False, True])
def test_a_stop_sequence_is_named_whole_and_streamed(fleet: tuple[Fleet, MessagesUpstream], streamed: bool) -> None:
    """The upstream stopped on one of the caller's stop_sequences: the caller is told
    `stop_sequence` and which one, streamed as well as whole (a stream used to say `end_turn`)."""
    f, _ = fleet
    kw: dict[str, Any] = dict(model="analysis", max_tokens=64, stop_sequences=["never", "Messages"],
                              messages=[{"role": "user", "content": "hi"}])
    if streamed:
        with client(f).messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            msg = s.get_final_message()
        assert text.strip() == GREETING[: GREETING.index("Messages")].strip()
    else:
        msg = client(f).messages.create(**kw)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "Messages"), msg
