"""The HTTP edge against a real gateway (`fleet gateway`), a real Redis and a sim worker: what a
caller, or an attacker, can send never gets stored whole, never holds a connection open for
ever, and every refusal is a typed OpenAI error (issue 12, items 1, 7 and 8).

Raw sockets where an HTTP client would tidy the request up (or wait for ever)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.harness import Fleet, serving, wait_until

HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 32_768  # the config's default
CHAT = {"model": "routing", "messages": [{"role": "user", "content": "route this"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def edge(redis_url: str) -> Iterator[Fleet]:
    with serving(redis_url, env_overrides={"FLEET_GATEWAY__HEADER_TIMEOUT_S": str(HEAD_TIMEOUT_S),
                                           "FLEET_GATEWAY__BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}) as f:
        yield f


def exchange(port: int, data: bytes, wait_s: float = 15.0) -> tuple[int | None, dict[str, str], bytes, float]:
    """Send `data`, read until the server closes. Raises socket.timeout if it keeps the connection open."""
    s = socket.create_connection(("127.0.0.1", port), timeout=wait_s)
    t0 = time.monotonic()
    try:
        s.sendall(data)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
        took = time.monotonic() - t0
    finally:
        s.close()
    if not buf:
        return None, {}, b"", took
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body, took


def typed(body: bytes) -> dict[str, Any]:
    err = orjson.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert set(err) >= {"message", "type", "param", "code"}, err
    return err


def chat(f: Fleet, body: Any = None, **headers: str) -> httpx.Response:
    return httpx.post(f"{f.base_url}/v1/chat/completions", json=CHAT if body is None else body,
                      headers=headers, timeout=30)


# --- item 1: headers and caller-supplied fields ----------------------------------------------------


def test_oversized_headers_are_a_typed_431_and_nothing_reaches_redis(edge: Fleet) -> None:
    before = edge.counters("routing").get("accepted", 0)
    big = "x" * (4 << 20)  # the probe's attack, at 4 MiB: refused while it arrives, not after
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           f"x-chain-id: {big}\r\ncontent-length: {len(orjson.dumps(CHAT))}\r\n\r\n").encode() + orjson.dumps(CHAT)
    status, headers, body, _ = exchange(edge.port, req)
    assert status == 431 and headers["connection"] == "close"
    assert typed(body)["code"] == "request_header_fields_too_large"
    # A head that arrives whole in one read, through an ordinary client, just over the limit.
    r = chat(edge, **{"x-chain-id": "y" * MAX_HEADER_BYTES})
    assert r.status_code == 431 and typed(r.content)["code"] == "request_header_fields_too_large"
    assert edge.counters("routing").get("accepted", 0) == before  # neither joined the line
    assert chat(edge).status_code == 200  # and the gateway serves the next caller


def test_chain_id_is_bounded_and_plain_or_a_typed_400(edge: Fleet) -> None:
    before = edge.counters("routing").get("accepted", 0)
    for bad in ("c" * 129, "has space", "semi;colon", "quote'", "slash/"):
        r = chat(edge, **{"x-chain-id": bad})
        assert r.status_code == 400, (bad, r.text)
        err = typed(r.content)
        assert (err["code"], err["param"]) == ("invalid_chain_id", "X-Chain-Id")
        assert len(err["message"]) < 300  # the value is not echoed back whole
    assert edge.counters("routing").get("accepted", 0) == before
    good = "desk-7:plan.42_step-3" + "z" * 107  # 128 characters
    r = chat(edge, **{"x-chain-id": good})
    assert r.status_code == 200, r.text
    assert edge.r.hget(edge.keys("routing").request(r.headers["x-request-id"]), "chain") == good.encode()


def raw_chat(port: int, name: bytes, value: bytes) -> tuple[int | None, bytes]:
    """A chat call with one header sent exactly as given (an HTTP client would strip or refuse some)."""
    body = orjson.dumps(CHAT)
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           + name + b": " + value + b"\r\nconnection: close\r\ncontent-length: "
           + str(len(body)).encode() + b"\r\n\r\n" + body)
    status, _, resp, _ = exchange(port, req)
    return status, resp


@pytest.mark.parametrize("raw", ["5_000", "+5000", "5 000", "05000", "5000.0", "5e3", "0", "٥٠٠٠"])
def test_deadline_header_is_plain_digits_or_a_typed_400(edge: Fleet, raw: str) -> None:
    status, resp = raw_chat(edge.port, b"x-deadline-ms", raw.encode())
    assert status == 400, (raw, resp)
    err = typed(resp)
    assert (err["code"], err["param"]) == ("invalid_deadline", "X-Deadline-Ms")


@pytest.mark.parametrize("raw", [" 5000 ", "5000 ", "5000\t"])
def test_whitespace_around_a_header_value_is_not_part_of_it(edge: Fleet, raw: str) -> None:
    """RFC 9110 5.5: a field value excludes its leading and trailing whitespace, so `5000 ` is the
    deadline 5000 (uvicorn strips it, from 0.55: the pinned range); whitespace inside is refused above."""
    status, resp = raw_chat(edge.port, b"x-deadline-ms", raw.encode())
    assert status == 200, (raw, resp)
    rid = orjson.loads(resp)["id"].removeprefix("chatcmpl-")
    deadline = edge.r.hget(edge.keys("routing").request(rid), "deadline")
    enq = edge.r.hget(edge.keys("routing").request(rid), "enq")
    assert deadline is not None and enq is not None and float(deadline) - float(enq) == 5000, (deadline, enq)


def test_priority_header_is_exactly_a_class_or_a_typed_400(edge: Fleet) -> None:
    for bad in ("Interactive", "inter active", "1", "urgent", "x" * 5000):
        status, resp = raw_chat(edge.port, b"x-priority", bad.encode())
        assert status == 400, (bad, resp)
        err = typed(resp)
        assert (err["code"], err["param"]) == ("invalid_priority", "X-Priority") and len(err["message"]) < 300
    assert chat(edge, **{"x-priority": "speculative"}).headers["x-fleet-priority"] == "speculative"


def _with(**fields: Any) -> dict[str, Any]:
    return {**CHAT, **fields}


BOUNDED = [
    (_with(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_with(stop="s" * 257), "stop"),
    (_with(stop=["s" * 257]), "stop.0"),
    (_with(user="u" * 257), "user"),
    (_with(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
    (_with(metadata={"k": "v" * 513}), "metadata.k"),
    (_with(messages=[{"role": "user", "content": "x"}] * 2049), "messages"),
    (_with(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 257}]), "messages.0.content"),
    (_with(messages=[{"role": "user", "content": [{"type": "", "text": "x"}]}]), "messages.0.content.0.type"),
    (_with(tools=[{"type": "function", "function": {"name": ""}}]), "tools.0.function.name"),
    (_with(model="m" * 257), "model"),
    (_with(seed=2**64), "seed"),
    (_with(n=2), "n"),
]


def test_every_field_that_reaches_redis_is_bounded(edge: Fleet) -> None:
    before = edge.counters("routing").get("accepted", 0)
    for body, param in BOUNDED:
        r = chat(edge, body)
        assert r.status_code == 422, (param, r.text)
        err = typed(r.content)
        assert (err["code"], err["param"]) == ("invalid_value", param), r.text
    assert edge.counters("routing").get("accepted", 0) == before  # nothing was stored
    # At the bounds, accepted.
    ok = _with(stop=["s" * 256] * 4, user="u" * 256, metadata={f"k{i}": "v" * 512 for i in range(16)},
               seed=2**64 - 1)
    assert chat(edge, ok).status_code == 200


def test_a_part_the_engine_cannot_take_is_a_typed_400_naming_it(edge: Fleet) -> None:
    """An image goes to the engine, never dropped in silence: the sim engine takes text only, and
    says which part it could not take."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = chat(edge, _with(messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]))
    assert r.status_code == 400, r.text
    err = typed(r.content)
    assert (err["code"], err["param"]) == ("unsupported_content", "messages[0].content[1]")
    assert "image_url" in err["message"]


# --- item 7: error shapes and strict types ----------------------------------------------------------


def test_unknown_paths_and_wrong_methods_are_typed(edge: Fleet) -> None:
    u = edge.base_url
    r = httpx.get(f"{u}/v2/nope")
    assert r.status_code == 404 and typed(r.content)["code"] == "not_found"
    for method, path in (("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("PUT", "/v1/fleet/status")):
        r = httpx.request(method, f"{u}{path}")
        assert r.status_code == 405, (method, path, r.text)
        assert typed(r.content)["code"] == "method_not_allowed" and r.headers["allow"]
    status, _, body, _ = exchange(edge.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and typed(body)["code"] == "invalid_http"


@pytest.mark.parametrize(("field", "value"), [("stream", "yes"), ("max_tokens", "10"), ("temperature", "1"),
                                              ("n", "1"), ("ignore_eos", 1), ("stream", 0), ("seed", 1.5)])
def test_strict_types_are_refused_not_coerced(edge: Fleet, field: str, value: Any) -> None:
    r = chat(edge, _with(**{field: value}))
    assert r.status_code == 422, r.text
    err = typed(r.content)
    assert (err["code"], err["param"]) == ("invalid_value", field)


def test_an_int_temperature_is_still_a_number(edge: Fleet) -> None:
    assert chat(edge, _with(temperature=1, top_p=1)).status_code == 200  # the openai client sends these


def test_a_one_ms_deadline_reads_in_ms(edge: Fleet) -> None:
    r = chat(edge, **{"x-deadline-ms": "1"})
    assert r.status_code == 429
    msg = typed(r.content)["message"]
    assert "deadline of 1 ms" in msg and "0.00 s" not in msg, msg


# --- item 8: slow clients ---------------------------------------------------------------------------


def test_a_head_that_never_completes_gets_a_408_and_the_connection_closes(edge: Fleet) -> None:
    status, headers, body, took = exchange(edge.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    assert status == 408 and headers["connection"] == "close" and typed(body)["code"] == "request_timeout"
    assert took < HEAD_TIMEOUT_S + 5  # the socket's own 15 s timeout would fail this test first


def test_a_body_shorter_than_its_length_gets_a_408_and_the_connection_closes(edge: Fleet) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n")
    status, headers, body, took = exchange(edge.port, head + b'{"model": "routing"')
    assert status == 408 and headers["connection"] == "close" and typed(body)["code"] == "request_timeout"
    assert took < BODY_TIMEOUT_S + 5
    assert chat(edge).status_code == 200  # the handler that was reading it let go cleanly


def test_a_body_the_app_refused_unread_gets_one_answer_then_the_close(edge: Fleet) -> None:
    # 413 from Content-Length alone; the client never sends the body it announced.
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000000\r\n\r\n"
    s = socket.create_connection(("127.0.0.1", edge.port), timeout=15)
    t0 = time.monotonic()
    try:
        s.sendall(head)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    finally:
        s.close()
    assert buf.startswith(b"HTTP/1.1 413") and buf.count(b"HTTP/1.1 ") == 1, buf
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 5


def test_pipelined_requests_are_still_answered_in_order(edge: Fleet) -> None:
    one = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    last = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    s = socket.create_connection(("127.0.0.1", edge.port), timeout=15)
    try:
        s.sendall(one + one + last)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    finally:
        s.close()
    assert buf.count(b"HTTP/1.1 200 OK") == 3 and buf.rstrip().endswith(b"}") and b'"routing"' in buf


def test_a_connection_that_sends_nothing_is_closed(edge: Fleet) -> None:
    status, _, _, took = exchange(edge.port, b"")
    assert status is None and took < HEAD_TIMEOUT_S + 5


def test_connections_per_client_address_are_bounded(redis_url: str) -> None:
    f = Fleet(redis_url, env_overrides={"FLEET_GATEWAY__MAX_CONNECTIONS_PER_CLIENT": "3"})
    held: list[socket.socket] = []
    try:
        f.start_gateway()
        held = [socket.create_connection(("127.0.0.1", f.port), timeout=15) for _ in range(3)]
        # Each connection counts from its accept: wait until the server holds all three.
        r = wait_until(lambda: (x := httpx.get(f"{f.base_url}/healthz")).status_code == 429 and x, 15,
                       what="the fourth connection refused")
        err = typed(r.content)
        assert (err["code"], err["type"]) == ("too_many_connections", "at_capacity")
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        held.pop().close()
        wait_until(lambda: httpx.get(f"{f.base_url}/healthz").status_code == 200, 15,
                   what="a connection freed is usable again")
    finally:
        for s in held:
            s.close()
        f.stop()
