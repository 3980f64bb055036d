"""The line's scripts are addressed by name (`fleet.store.lua.Script`): only their binding
prologue reads KEYS and ARGV, keys come from KEYS or from helpers generated from `TierKeys`,
constants are rendered from Python, and a call with a name missing or unknown fails in Python
before Redis sees it."""

from __future__ import annotations

import importlib
import re
import uuid

import pytest
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.store.connection import connect
from fleet.store.keys import TierKeys
from fleet.store.line import Line
from fleet.store.line_lua import CLASS_SPAN
from fleet.store.lua import BINDINGS_END, KEY_HELPERS, SHEBANG, Script, ScriptArgumentError, named
from tests.paths import ROOT

STORE = ROOT / "fleet" / "store"


def _scripts() -> dict[str, Script]:
    """Every `Script` a module of fleet/store defines, by module.name."""
    out = {}
    for path in sorted(STORE.glob("*.py")):
        mod = importlib.import_module(f"fleet.store.{path.stem}")
        for value in vars(mod).values():
            if isinstance(value, Script):
                out.setdefault(value.name, value)
    return out


def _after_bindings(text: str) -> str:
    _, sep, rest = text.partition(BINDINGS_END)
    assert sep, "no binding prologue"
    return rest


def test_the_line_admission_and_affinity_scripts_are_all_named() -> None:
    names = set(_scripts())
    assert {"ENQUEUE", "CLAIM", "AFFINE_CLAIM", "RENEW", "FINISH", "EMIT", "REAP", "OBSERVE", "PEEK", "PREEMPT",
            "MISSING", "SWEEP", "OBSERVE_AND_MARK"} <= names, names


@pytest.mark.parametrize("name", sorted(_scripts()))
def test_no_script_reads_a_position_outside_its_bindings(name: str) -> None:
    text = _scripts()[name]
    assert text.startswith(SHEBANG)
    prologue = text[len(SHEBANG):text.index(BINDINGS_END)]
    for line in prologue.splitlines():  # bindings only: `local x = KEYS[i]` / `ARGV[i]`, and the rows loop
        assert line.startswith(("local ", "for i = ")), line
    body = _after_bindings(text)
    assert "ARGV[" not in body and "KEYS[" not in body, f"{name} reads a position after its bindings"


@pytest.mark.parametrize("name", sorted(_scripts()))
def test_no_key_is_built_by_hand_and_no_constant_written_out(name: str) -> None:
    body = _after_bindings(_scripts()[name])
    helpers = [ln for ln in body.splitlines() if re.match(rf"local function ({'|'.join(KEY_HELPERS)})\(", ln)]
    rest = "\n".join(ln for ln in body.splitlines() if ln not in helpers)
    assert "prefix .." not in rest, f"{name} concatenates a key by hand"
    assert not re.search(r"'(req|res|calls|wake):'", rest), f"{name} spells a key family itself"
    assert "1e15" not in rest, f"{name} writes the class span out instead of CLASS_SPAN"
    if "CLASS_SPAN" in rest:
        assert f"local CLASS_SPAN = {CLASS_SPAN}\n" in body


def test_claim_and_affine_claim_take_a_call_with_one_function() -> None:
    s = _scripts()
    for name in ("CLAIM", "AFFINE_CLAIM"):
        body = _after_bindings(s[name])
        assert body.count("local function take(") == 1 and "take(rid, " in body, name
        assert "'running', 'owner', owner" in body[body.index("local function take("):]
        assert body.count("'running', 'owner'") == 1, f"{name} writes a claim outside `take`"


def test_a_call_missing_or_inventing_a_name_fails_before_redis() -> None:
    s = Script("T", keys=("line",), optional_keys=("wake",), args=("rid", "n"), body="return {line, rid, n}")
    assert s.layout({"line": "L", "wake": None, "rid": "r", "n": 3}) == (["L"], ["r", 3])
    assert s.layout({"line": "L", "wake": "W", "rid": "r", "n": 3}) == (["L", "W"], ["r", 3])
    with pytest.raises(ScriptArgumentError, match=r"T: missing \['n'\], unknown \[\]"):
        s.layout({"line": "L", "wake": None, "rid": "r"})
    with pytest.raises(ScriptArgumentError, match=r"missing \[\], unknown \['rids'\]"):
        s.layout({"line": "L", "wake": None, "rid": "r", "n": 1, "rids": 2})
    rows = Script("R", keys=("inflight",), rows=("held", ("req",), ("rid", "owner")), body="return #held")
    with pytest.raises(ScriptArgumentError, match="a row of held"):
        rows.layout({"inflight": "I", "held": [{"req": "q", "rid": "r"}]})
    with pytest.raises(ValueError, match="prefix"):
        Script("P", args=("x",), body="return request_key(x)")


async def test_the_line_refuses_a_wrong_name_and_redis_sees_nothing(redis_url: str) -> None:
    r = connect(redis_url)
    line = Line(r, f"t{uuid.uuid4().hex[:8]}", "routing")
    await line.observe()  # scripts loaded, so any call that reached Redis would show as an EVALSHA
    before = (await r.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)
    with pytest.raises(ScriptArgumentError, match="ENQUEUE: missing"):
        await line._enqueue(line=line.keys.line, rid="x")
    with pytest.raises(ScriptArgumentError, match=r"unknown \['lease'\]"):
        await line._peek(line=line.keys.line, prefix=line.prefix, scan=1, below_rank=4, stale_ms=1, lease=1)
    after = (await r.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)
    assert after == before
    assert await r.zcard(line.keys.line) == 0
    await r.aclose()


async def test_key_helpers_build_the_keys_of_keys_py(redis_url: str) -> None:
    r: Redis = connect(redis_url)
    k = TierKeys(f"t{uuid.uuid4().hex[:8]}", "routing")
    s = named(r.register_script(Script(
        "KEYS_OF", args=("prefix", "id"), clock=False,
        body="return {request_key(id), result_key(id), calls_key(id), wake_key(id)}")))
    got = [b.decode() for b in await s(prefix=k.prefix, id="a1")]
    assert got == [k.request("a1"), k.result("a1"), k.calls("a1"), k.wake("a1")]
    await r.aclose()


async def test_rows_and_an_absent_optional_key_bind_by_name(redis_url: str) -> None:
    """The row loop of the prologue and the trailing optional key, as a script sees them."""
    r: Redis = connect(redis_url)
    k = TierKeys(f"t{uuid.uuid4().hex[:8]}", "routing")
    s = named(r.register_script(Script(
        "ROWS", keys=("line",), args=("n",), rows=("held", ("req",), ("rid", "owner")), clock=False, body="""
local out = {line, n}
for _, h in ipairs(held) do out[#out + 1] = h.req .. '/' .. h.rid .. '/' .. h.owner end
return out""")))
    got = await s(line=k.line, n="2", held=[{"req": k.request("a"), "rid": "a", "owner": "w:1"},
                                             {"req": k.request("b"), "rid": "b", "owner": "w:2"}])
    assert [g.decode() for g in got] == [k.line, "2", f"{k.request('a')}/a/w:1", f"{k.request('b')}/b/w:2"]
    # the line's own enqueue with no reader wake: the optional key is absent, the call joins
    line = Line(r, k.namespace, k.tier)
    await line.enqueue("c1", Priority.committed, b"{}", 5000)
    assert await r.zscore(line.keys.line, "c1") == pytest.approx(Priority.committed * CLASS_SPAN + 1)
    await r.aclose()
