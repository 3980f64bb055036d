"""The calls agents make skip the framework's layers (gateway.hot_paths) and answer exactly as
through them: every refusal the same status, body and headers, on a real Redis."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from fleet.config import load_config
from fleet.store.keys import TierKeys
from gateway.app import create_app
from tests.harness import TEST_CONFIG

CHAT = {"model": "routing", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (path, body, headers): each is refused before it reaches the line.
REFUSALS: list[tuple[str, Any, dict[str, str]]] = [
    ("/v1/chat/completions", b"{not json", {}),
    ("/v1/chat/completions", {**CHAT, "model": "no-such-tier"}, {}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "10"}, {}),
    ("/v1/chat/completions", {"model": "routing"}, {}),
    ("/v1/chat/completions", CHAT, {"x-deadline-ms": "5 000"}),
    ("/v1/chat/completions", CHAT, {"x-chain-id": "a b"}),
    ("/v1/chat/completions", CHAT, {"x-priority": "urgent"}),
    ("/v1/chat/completions", CHAT, {"x-padding": "p" * 70_000}),
    ("/v1/completions", {"model": "routing"}, {}),
    ("/v1/completions", {"model": "routing", "prompt": "hi", "n": 2}, {}),
    ("/v1/responses", {"model": "routing", "input": "hi", "background": True}, {}),
    ("/v1/responses", {"model": "routing", "input": "hi", "previous_response_id": "resp_missing"}, {}),
]


@pytest.fixture
def client(redis_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(load_config(TEST_CONFIG), redis_url)) as c:
        yield c


def _answer(c: TestClient, path: str, body: Any, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
    kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = c.post(path, headers=headers, **kw)
    kept = {k: v for k, v in r.headers.items() if k not in ("date", "content-length")}
    return r.status_code, r.content, kept


def test_hot_routes_answer_as_the_framework_routes_do(client: TestClient) -> None:
    app: Any = client.app
    hot = dict(app.hot)
    for path, body, headers in REFUSALS:
        fast = _answer(client, path, body, headers)
        app.hot = {}  # the same request through FastAPI's route
        try:
            framework = _answer(client, path, body, headers)
        finally:
            app.hot = hot
        assert fast == framework, (path, body)
        assert 400 <= fast[0] < 500 and b'"error"' in fast[1], (path, fast)


def test_a_bug_in_a_hot_route_is_a_typed_logged_500(client: TestClient, redis_url: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    app: Any = client.app

    async def broken(_: Any) -> Any:
        raise ValueError("a bug")

    app.hot = {**app.hot, "/v1/chat/completions": broken}
    with caplog.at_level(logging.ERROR, logger="fleet.gateway"):
        r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert any("unhandled error on POST /v1/chat/completions" in m for m in caplog.messages)


def test_an_oversized_head_on_a_hot_route_joins_no_line(client: TestClient, redis_url: str) -> None:
    counters = TierKeys(load_config(TEST_CONFIG).namespace, "routing").counters
    r0 = redis.Redis.from_url(redis_url)
    before = r0.hget(counters, "accepted")
    r = client.post("/v1/chat/completions", json=CHAT, headers={"x-padding": "p" * 70_000})
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
    assert r.headers["connection"] == "close"
    assert r0.hget(counters, "accepted") == before
    r0.close()
