"""The layout shows the architecture, and the build fails when it stops doing so:

- the core package `fleet/` imports no part (gateway, workers, scaler, simulator, the command);
- each part imports only the core and itself: the gateway and the workers meet only in Redis,
  the scaler and the simulator share only the policy; only the command (`fleetctl/`) sees them all;
- no import cycle between modules, counting every import (inside functions and under
  TYPE_CHECKING too: a cycle hidden there is still a cycle in the design);
- no module over 400 lines, and no function of the product over 80 (a tier's tick, a call's
  life: each reads as a few named steps, not one long page).

Read from the source with `ast`, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

from tests.paths import ROOT

PACKAGES = ("fleet", "fleetctl", "gateway", "workers", "scaler", "simulator")
# What each top-level package may import of ours, besides itself.
ALLOWED: dict[str, set[str]] = {
    "fleet": set(),
    "gateway": {"fleet"},
    "workers": {"fleet"},
    "scaler": {"fleet"},
    "simulator": {"fleet"},
    "fleetctl": {"fleet", "gateway", "workers", "scaler", "simulator"},
}
MAX_LINES = 400
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, str]:
    """Every module of the packages, by dotted name."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = path.read_text()
    return out


def imports(name: str, source: str, known: Mapping[str, str]) -> Iterator[tuple[str, int]]:
    """(module imported, line) for each import of one of `known`, wherever it stands in the file."""
    is_pkg = name in PACKAGES or any(k.startswith(name + ".") for k in known)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


def graph(mods: Mapping[str, str]) -> dict[str, set[str]]:
    return {m: {t for t, _ in imports(m, src, mods) if t in mods and t != m} for m, src in mods.items()}


def cycles(g: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layering_violations(mods: Mapping[str, str]) -> list[str]:
    bad = []
    for m, src in mods.items():
        top = m.split(".")[0]
        for target, line in imports(m, src, mods):
            other = target.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                may = sorted(ALLOWED[top]) or "nothing of ours"
                bad.append(f"{m}:{line} imports {target} ({top}/ may import {may})")
    return bad


def test_the_core_imports_no_part_and_the_parts_only_the_core() -> None:
    assert layering_violations(sources()) == []


def test_there_is_no_import_cycle() -> None:
    assert cycles(graph(sources())) == []


def test_no_module_is_over_400_lines() -> None:
    long = {m: n for m, src in sources().items() if (n := len(src.splitlines())) > MAX_LINES}
    assert long == {}, long


def long_functions(mods: Mapping[str, str], limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Functions and methods (nested ones too) longer than `limit` lines, decorators and
    docstring included, by `module:function:line`."""
    out = {}
    for m, src in mods.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = (node.end_lineno or node.lineno) - start + 1
                if n > limit:
                    out[f"{m}:{node.name}:{node.lineno}"] = n
    return out


def test_no_product_function_is_over_80_lines() -> None:
    assert long_functions(sources()) == {}


def test_the_checks_catch_what_they_are_for() -> None:
    """Fed a core that reaches into a part and two modules that import each other (one of them
    lazily, inside a function, as the old `fleet.latency` did), the checks say so."""
    mods = {
        "fleet": "",
        "fleet.a": "from fleet.b import x\n",
        "fleet.b": "def f():\n    from fleet import a\n",
        "fleet.c": "import gateway.app\n",
        "gateway": "",
        "gateway.app": "from fleet.a import y\n",
        "fleetctl": "",
        "fleetctl.cli": "from gateway.app import z\nfrom . import cli\n",
    }
    assert cycles(graph(mods)) == [["fleet.a", "fleet.b"]]
    body = "".join(f"    x{i} = {i}\n" for i in range(79))  # with its `def`, 80 lines: allowed
    assert long_functions({"fleet.d": f"def short():\n{body}\nasync def long():\n{body}    return 1\n"}) == {
        "fleet.d:long:82": 81}
    assert [v.split(" ")[0] for v in layering_violations(mods)] == ["fleet.c:1"]
