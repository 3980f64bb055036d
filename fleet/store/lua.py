"""The Lua every script of the store starts with: the shebang that holds it to one
cluster slot, and Redis's own clock, in milliseconds; and `Script`, the spec that names a
script's keys and arguments.

One clock for the whole fleet: deadlines, leases, accrual marks and budget
reservations are all judged on the Redis server's TIME, so the gateways',
workers' and scaler's clocks need not agree.

A `Script` declares its KEYS and ARGV by name. Its Lua opens with the binding prologue
(`local line = KEYS[1]` ...) and nothing after that prologue reads KEYS or ARGV: the body
and the fragments it uses (Lua functions, given what they need as parameters) see only
named locals. Constants are rendered into it from Python (`consts`), and the keys a script
builds from a tier's prefix come from helpers generated from `fleet.store.keys.TierKeys`
(`request_key(rid)` ...). The Python side calls it with keyword arguments
(`named(redis.register_script(S))(line=..., rid=...)`); a missing or unknown name fails in
Python, before Redis is called.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from fleet.store.keys import TierKeys

# The first line of every script the store registers. A script that declares
# itself this way is held by Redis Cluster to one slot: touching a key of
# another slot (another tier's, say) fails the script with "Script attempted to
# access keys that do not hash to the same slot", where a script without it
# would silently work whenever both slots happen to live on one node. Needs
# Redis >= 7.0. tests/pure/test_store_scripts_declared.py checks every registered script starts so.
SHEBANG = "#!lua\n"

# Redis's clock: `now`, and `n2s` for every number bound for Redis.
TIME = """local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Redis turns Lua numbers into strings with 14 significant digits; scores and
-- amounts need all 16, so every number bound for Redis goes through n2s.
local function n2s(x) return string.format('%.0f', x) end
"""

CLOCK = SHEBANG + TIME

# The last line of a Script's binding prologue: below it, no KEYS[ nor ARGV[ (tests/store/test_script_spec.py).
BINDINGS_END = "-- end of bindings\n"

# Lua helpers for the keys of one tier that a script builds from its `prefix` argument (the
# tier's `TierKeys.prefix`): name -> the TierKeys method they mirror. Rendered into a script
# that uses them, after its bindings, so the layout lives in fleet/store/keys.py alone.
KEY_HELPERS: dict[str, str] = {
    "request_key": "request",
    "result_key": "result",
    "calls_key": "calls",
    "wake_key": "wake",
}

_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


class ScriptArgumentError(TypeError):
    """A script was called with a name missing or one it does not declare."""


def lua_value(v: int | str) -> str:
    """A Python constant as a Lua literal (an int stays exact up to 2^53, Lua's numbers being doubles)."""
    if isinstance(v, bool):
        raise TypeError("no booleans in Lua constants")
    if isinstance(v, int):
        if abs(v) > 2**53:
            raise ValueError(f"{v} is not exact in a Lua number")
        return str(v)
    if re.fullmatch(r"[\w:.-]*", v):
        return f"'{v}'"
    assert "]==]" not in v
    return f"[==[{v}]==]"


def _key_helper(name: str, method: str) -> str:
    """`local function request_key(id) return prefix .. 'req:' .. id end`, from TierKeys."""
    k = TierKeys("\x01", "\x02")
    sample: str = getattr(k, method)("\x03")
    head, _, tail = sample[len(k.prefix):].partition("\x03")
    assert sample.startswith(k.prefix) and "\x01" not in head + tail and "'" not in head + tail
    body = f"prefix .. '{head}' .. id" + (f" .. '{tail}'" if tail else "")
    return f"local function {name}(id) return {body} end\n"


def _uses(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text) is not None


class Script(str):
    """A registered script's Lua text, carrying the names of its KEYS and ARGV.

    - `keys`: KEYS in order; `optional_keys` after them, passed as None when absent (only at the
      tail: one absent is never followed by one present). Bound as `local name = KEYS[i]` (nil
      when absent).
    - `args`: ARGV in order, every one required (pass '' for none); bound as strings.
    - `rows` (name, row keys, row args): a list after the fixed KEYS and ARGV, one group per
      entry, bound as `local name = {{key = ..., arg = ...}, ...}`; a row is a mapping of
      exactly those names.
    - `clock`: the script needs `now` and `n2s` (`TIME`); `consts`: Python constants rendered
      as `local NAME = value`, those the text names; `uses`: Lua fragments (functions) in order.
    """

    name: str
    keys: tuple[str, ...]
    optional_keys: tuple[str, ...]
    args: tuple[str, ...]
    rows: tuple[str, tuple[str, ...], tuple[str, ...]] | None
    _names: frozenset[str]

    def __new__(cls, name: str, *, keys: Iterable[str] = (), args: Iterable[str] = (),
                optional_keys: Iterable[str] = (),
                rows: tuple[str, tuple[str, ...], tuple[str, ...]] | None = None,
                clock: bool = True, consts: Mapping[str, int | str] | None = None,
                uses: Iterable[str] = (), body: str) -> Script:
        keys, optional_keys, args = tuple(keys), tuple(optional_keys), tuple(args)
        declared = [*keys, *optional_keys, *args, *((rows[0],) if rows else ())]
        row_names = [*rows[1], *rows[2]] if rows else []
        for n in declared + row_names:
            if not _NAME.match(n):
                raise ValueError(f"{name}: {n!r} is no Lua name")
        if len(set(declared)) != len(declared) or len(set(row_names)) != len(row_names):
            raise ValueError(f"{name}: a name declared twice in {declared} {row_names}")
        if rows and optional_keys:
            raise ValueError(f"{name}: rows after optional keys cannot be told apart")
        code = "".join(dict.fromkeys(uses)) + body  # each fragment once, in order
        text = SHEBANG + _prologue(keys, optional_keys, args, rows) + BINDINGS_END
        if clock:
            text += TIME
        for c, v in (consts or {}).items():
            if _uses(code, c):
                text += f"local {c} = {lua_value(v)}\n"
        helpers = [h for h in KEY_HELPERS if _uses(code, h)]
        if helpers and "prefix" not in args:
            raise ValueError(f"{name}: {helpers} build keys from a `prefix` argument it does not declare")
        text += "".join(_key_helper(h, KEY_HELPERS[h]) for h in helpers) + code
        self = super().__new__(cls, text)
        self.name, self.keys, self.optional_keys, self.args, self.rows = name, keys, optional_keys, args, rows
        self._names = frozenset(declared)
        return self

    def layout(self, named: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
        """KEYS and ARGV for a call given by name; ScriptArgumentError on a name missing or unknown."""
        if named.keys() != self._names:
            missing = sorted(self._names - named.keys())
            unknown = sorted(named.keys() - self._names)
            raise ScriptArgumentError(f"{self.name}: missing {missing}, unknown {unknown}")
        keys = [named[k] for k in self.keys]
        gap = ""
        for k in self.optional_keys:
            if named[k] is None:
                gap = gap or k
            elif gap:
                raise ScriptArgumentError(f"{self.name}: optional key {k} given without {gap}, which comes before it")
            else:
                keys.append(named[k])
        args = [named[a] for a in self.args]
        if self.rows:
            rname, rkeys, rargs = self.rows
            want = frozenset((*rkeys, *rargs))
            for row in named[rname]:
                if row.keys() != want:
                    raise ScriptArgumentError(f"{self.name}: a row of {rname} has {sorted(row)}, not {sorted(want)}")
                keys.extend(row[k] for k in rkeys)
                args.extend(row[a] for a in rargs)
        return keys, args


def _prologue(keys: tuple[str, ...], optional_keys: tuple[str, ...], args: tuple[str, ...],
              rows: tuple[str, tuple[str, ...], tuple[str, ...]] | None) -> str:
    """The binding lines: the only ones of a script that read KEYS and ARGV."""
    out = [f"local {n} = KEYS[{i}]\n" for i, n in enumerate((*keys, *optional_keys), 1)]
    out += [f"local {n} = ARGV[{i}]\n" for i, n in enumerate(args, 1)]
    if rows:
        rname, rkeys, rargs = rows
        count = f"(#KEYS - {len(keys)}) / {len(rkeys)}" if rkeys else f"(#ARGV - {len(args)}) / {len(rargs)}"
        fields = [f"{n} = KEYS[{len(keys) + 1 + j} + i * {len(rkeys)}]" for j, n in enumerate(rkeys)]
        fields += [f"{n} = ARGV[{len(args) + 1 + j} + i * {len(rargs)}]" for j, n in enumerate(rargs)]
        out.append(f"local {rname} = {{}}\nfor i = 0, {count} - 1 do {rname}[i + 1] = {{{', '.join(fields)}}} end\n")
    return "".join(out)


class Named:
    """A registered `Script` called by name: `await s(line=..., rid=...)`. `sha`, `script` and
    `layout` serve the callers that send EVALSHA themselves (a pipeline, a WAIT behind it)."""

    __slots__ = ("registered", "script", "sha", "spec")

    def __init__(self, registered: Any) -> None:
        spec = registered.script
        if not isinstance(spec, Script):
            raise TypeError("register a fleet.store.lua.Script to call it by name")
        self.registered, self.spec, self.script, self.sha = registered, spec, registered.script, registered.sha

    def layout(self, **named: Any) -> tuple[list[Any], list[Any]]:
        return self.spec.layout(named)

    async def __call__(self, **named: Any) -> Any:
        keys, args = self.spec.layout(named)
        return await self.registered(keys=keys, args=args)


def named(registered: Any) -> Named:
    """`redis.register_script(S)` for a `Script` S, called by name from here on."""
    return Named(registered)
