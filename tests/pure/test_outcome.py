"""One outcome type (`fleet.outcome`): its words are the ones stored and exported, every cause maps
to one, the line's scripts write no other, and no outcome is spelt as a string outside it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fleet.outcome import (
    GATEWAY_ONLY,
    LINE_OUTCOMES,
    CallerLeft,
    Outcome,
    infer_outcome,
    of_failure_type,
    recorded_in_line,
)
from fleet.store.events import REQUEST_LOST, Done, Failed
from gateway.client_watch import ClientGone
from gateway.errors import APIError
from gateway.results import EXPIRED, RESULT_LOST
from gateway.retry_join import GONE
from tests.paths import ROOT

# The words in Redis (request hashes, the line's counters), in fleet_requests_total{outcome} and
# in docs/metrics.md: renaming one loses history, so each is pinned here.
WORDS = {"COMPLETED": "completed", "EXPIRED": "expired", "CANCELLED": "cancelled", "FAILED": "failed",
         "UNAVAILABLE": "unavailable", "SHED": "shed", "REFUSED": "refused"}

DONE = Done(attempt=1, finish_reason="stop", usage={"prompt_tokens": 1, "completion_tokens": 1})

# Every kind of cause a call can end by, and its outcome.
CAUSES: list[tuple[object, Outcome]] = [
    (DONE, Outcome.COMPLETED),  # the worker's answer
    (Failed(500, "engine_error", "the engine failed"), Outcome.FAILED),  # a worker's failure
    (Failed(502, "bad_answer", "x"), Outcome.FAILED),
    (EXPIRED, Outcome.EXPIRED),  # the gateway's clock ended it
    (RESULT_LOST, Outcome.EXPIRED),  # its deadline passed with its result lost
    (Failed(504, "deadline_exceeded", "in the line"), Outcome.EXPIRED),  # the line's own expiry
    (GONE, Outcome.CANCELLED),  # no retry came for a parked call
    (Failed(409, "cancelled", "its chain was cancelled"), Outcome.CANCELLED),
    (REQUEST_LOST, Outcome.FAILED),  # its request vanished from Redis (a failover)
    (ClientGone(), Outcome.CANCELLED),  # the caller left
    (ClientGone, Outcome.CANCELLED),  # ... given as a type
    (CallerLeft, Outcome.CANCELLED),
    (APIError(429, "at capacity", "at_capacity"), Outcome.SHED),  # admission's refusal
    (APIError(400, "bad body"), Outcome.REFUSED),  # its body, key, headers
    (APIError(401, "no key"), Outcome.REFUSED),
    (APIError(409, "chain cancelled"), Outcome.REFUSED),  # a new call of a cancelled chain
    (APIError(503, "Redis away", "service_unavailable"), Outcome.UNAVAILABLE),
    (APIError(502, "streamed a whole answer", "engine_error"), Outcome.FAILED),  # the worker's fault
    (429, Outcome.SHED), (400, Outcome.REFUSED), (503, Outcome.UNAVAILABLE), (499, Outcome.CANCELLED),
    (RedisConnectionError("down"), Outcome.UNAVAILABLE),  # Redis away
    (RedisTimeoutError("frozen"), Outcome.UNAVAILABLE),
    (TimeoutError(), Outcome.UNAVAILABLE),  # Redis silent past the deadline's grace
    (ValueError("a bug"), Outcome.FAILED),  # anything else is the fleet's failure
    (None, Outcome.FAILED),  # a path that forgot its end
]


def test_every_outcome_is_the_word_used_today() -> None:
    assert {o.name: o.value for o in Outcome} == WORDS
    assert all(str(o) == o.value and f"{o}" == o.value for o in Outcome)  # labels and Redis args as is
    assert {Outcome.SHED, Outcome.REFUSED} == GATEWAY_ONLY
    assert all(o.gateway_only == (o in GATEWAY_ONLY) for o in Outcome)
    assert LINE_OUTCOMES == (Outcome.COMPLETED, Outcome.EXPIRED, Outcome.CANCELLED, Outcome.FAILED,
                             Outcome.UNAVAILABLE)


@pytest.mark.parametrize(("cause", "outcome"), CAUSES, ids=lambda c: type(c).__name__ if not isinstance(c, int) else c)
def test_every_cause_maps_to_its_outcome(cause: object, outcome: Outcome) -> None:
    assert infer_outcome(cause) is outcome  # type: ignore[arg-type]


def test_every_outcome_is_reached_by_some_cause() -> None:
    assert {o for _, o in CAUSES} == set(Outcome)


def test_what_the_line_records_for_an_end_the_gateway_decides() -> None:
    """A caller gone, a deadline passed, Redis away stand as told; the rest is the fleet's failure."""
    assert {o: recorded_in_line(o) for o in Outcome} == {
        Outcome.COMPLETED: Outcome.FAILED, Outcome.EXPIRED: Outcome.EXPIRED, Outcome.CANCELLED: Outcome.CANCELLED,
        Outcome.FAILED: Outcome.FAILED, Outcome.UNAVAILABLE: Outcome.UNAVAILABLE, Outcome.SHED: Outcome.FAILED,
        Outcome.REFUSED: Outcome.FAILED}
    assert all(recorded_in_line(o) in LINE_OUTCOMES for o in Outcome)
    assert of_failure_type("anything_new") is Outcome.FAILED


# --- the line's scripts: their words are the type's -------------------------------------------

# The store modules whose text holds the line's Lua (another change owns them; read, never imported).
LUA_MODULES = ("line_scripts", "line_lua", "affinity", "callers", "admitting", "retries", "lua", "keys", "line",
               "flows")
# Counters the scripts keep that are not outcomes.
NOT_OUTCOMES = {"accepted", "requeued", "preempted", "prompt_tokens", "completion_tokens"}


def _lua_text() -> str:
    return "\n".join((ROOT / "fleet" / "store" / f"{m}.py").read_text() for m in LUA_MODULES
                     if (ROOT / "fleet" / "store" / f"{m}.py").exists())


def test_the_line_scripts_write_only_outcomes_of_the_type() -> None:
    """Their words, spelt in the Lua ('expired') or named as the scripts' constants (OUTCOME_EXPIRED,
    made from `OUTCOMES`): each a word of the line's outcomes."""
    text = _lua_text()
    retired = set(re.findall(r"retire\([^,()]+,[^,()]+,\s*'([a-z_]+)'", text))  # a request's end, as stored
    counted = {w for w in re.findall(r"HINCRBY',\s*[^,()]+,\s*'([a-z_]+)'", text) if w not in NOT_OUTCOMES}
    finishes = set(re.findall(r"ARGV\[\d+\]\s*==\s*'([a-z_]+)'", text))  # FINISH's outcome argument
    named = {w.lower() for w in re.findall(r"\bOUTCOME_([A-Z]+)\b", text)}
    line = {o.value for o in LINE_OUTCOMES}
    assert retired | named >= {"expired", "failed", "unavailable"}, (retired, named)  # the scan finds the ends
    assert retired <= line and counted <= line and finishes <= line and named <= line, (
        retired, counted, finishes, named)
    declared = re.search(r"^OUTCOMES\s*=\s*\(([^)]*)\)", text, re.M)
    if declared is not None:  # the scripts' own tuple, while it lasts, is the line's words in order
        assert tuple(re.findall(r"\"([a-z_]+)\"", declared.group(1))) == tuple(LINE_OUTCOMES)


# --- no outcome spelt as a string outside the type ---------------------------------------------

# A literal equal to an outcome's word that is not an outcome: (file, word) and why.
NOT_AN_OUTCOME: dict[tuple[str, str], str] = {
    ("gateway/responses_map.py", "completed"): "the Responses API's `status` of a response or item",
    ("gateway/responses_stream.py", "completed"): "the Responses API's `status` of a response or item",
    ("gateway/responses_stream.py", "failed"): "the Responses API's `status` of a failed response",
    ("gateway/status.py", "completed"): "the line's counters read by name beside accepted and requeued "
                                        "(not an end decided here)",
    ("gateway/status.py", "expired"): "the line's counters read by name",
    ("gateway/status.py", "cancelled"): "the line's counters read by name",
    ("gateway/status.py", "failed"): "the line's counters read by name",
    ("workers/engines/sim_answers.py", "shed"): "a word the sim engine's answers are made of",
}


def _scanned() -> list[Path]:
    lua = {ROOT / "fleet" / "store" / f"{m}.py" for m in LUA_MODULES}
    return sorted(ROOT.glob("gateway/*.py")) + sorted(ROOT.glob("workers/**/*.py")) + sorted(
        p for p in ROOT.glob("fleet/**/*.py") if p != ROOT / "fleet" / "outcome.py" and p not in lua)


def outcome_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String literals equal to an outcome's word used as a value: compared, assigned, returned,
    passed, defaulted, listed. Not: docstrings, f-string parts, dict keys and subscripts (a key
    named like an outcome: a counter's or a JSON member's name), nor a failure event's error type
    (`Failed(..., "cancelled", ...)`: `of_failure_type` maps it)."""
    words = {o.value for o in Outcome}
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value in words):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Expr | ast.JoinedStr | ast.BinOp):
            continue
        if isinstance(parent, ast.Subscript) and parent.slice is node:
            continue
        if isinstance(parent, ast.Dict) and node in parent.keys:
            continue
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "Failed":
            continue
        found.append((node.lineno, str(node.value)))
    return found


def test_the_scan_finds_an_outcome_spelt_as_a_string() -> None:
    code = 'def f(call, x):\n    call.end("cancelled")\n    if x == "shed":\n        y = "failed"\n' \
           '    return ("expired", 1)\n'
    assert [w for _, w in outcome_literals(ast.parse(code))] == ["cancelled", "shed", "failed", "expired"]
    fine = ('"""completed"""\nd = {"completed": 1}\nn = c["expired"]\nk = p + "cancelled"\n'
            'F = Failed(1, "cancelled", "m")\n')
    assert outcome_literals(ast.parse(fine)) == []


def test_no_outcome_literal_outside_the_type() -> None:
    stray = []
    for path in _scanned():
        rel = path.relative_to(ROOT).as_posix()
        for line, word in outcome_literals(ast.parse(path.read_text())):
            if (rel, word) not in NOT_AN_OUTCOME:
                stray.append(f"{rel}:{line}: {word!r} (use fleet.outcome.Outcome)")
    assert stray == []


def test_every_allowed_literal_is_still_there() -> None:
    """An allow-list entry whose literal is gone is dropped, so the list only says what is true."""
    seen = {(p.relative_to(ROOT).as_posix(), w)
            for p in _scanned() for _, w in outcome_literals(ast.parse(p.read_text()))}
    assert set(NOT_AN_OUTCOME) <= seen
