"""Claude Code as a client: npm's `@anthropic-ai/claude-code`, headless (`claude -p ...
--output-format json`), with `ANTHROPIC_BASE_URL` at a `sim` fleet and one of its stored keys,
runs to a clean result: plain, and with a tool (the tool_use it runs, its tool_result sent back,
a final text). What it sends is Claude Code's own (a `HEAD /`, `POST /v1/messages?beta=true`,
`anthropic-beta`, `thinking: adaptive`, `output_config`, `context_management`, system blocks
with `cache_control`, tools in JSON Schema 2020-12, streamed): none of it may be refused.

It is installed by `make claude-code` (cached in .cache/, gitignored) on first use; the tests
skip, saying why, only when npm cannot install it. Each run has a throwaway HOME and config
dir, and no traffic beyond the fleet (`CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.harness import ROOT, Fleet, serving, wait_until

CLAUDE = ROOT / ".cache" / "claude-code" / "node_modules" / ".bin" / "claude"
TIER = "routing"  # a `sim` tier: it calls the first tool offered, and answers a tool's result with text quoting it


@pytest.fixture(scope="module")
def claude() -> Path:
    """Claude Code's CLI, installed by `make claude-code` when missing or of another version (npm
    is needed only then)."""
    made = subprocess.run(
        ["make", "--no-print-directory", "claude-code"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    if made.returncode != 0:
        said = (made.stdout + made.stderr).strip()[-800:]
        if not CLAUDE.exists():  # npm could not install it; a binary that is there and fails is a failure
            pytest.skip(f"npm could not install Claude Code (make claude-code): {said}")
        raise AssertionError(f"Claude Code is installed but does not run: {said}")
    return CLAUDE


@pytest.fixture(scope="module")
def keyed(redis_url: str) -> Iterator[tuple[Fleet, str]]:
    """A sim fleet closed by one stored key (Claude Code sends it as `x-api-key`)."""
    with serving(redis_url, (TIER,)) as f:
        made = subprocess.run(
            [sys.executable, "-m", "fleetctl", "keys", "add", "claude-code"],
            env=f.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
        wait_until(
            lambda: (
                httpx.post(f"{f.base_url}/v1/messages/count_tokens", json={"model": TIER, "messages": []}).status_code
                == 401
            ),
            10,
            what="the gateway closed by the key",
        )
        yield f, made.stdout.strip()


def run_claude(claude: Path, fleet: tuple[Fleet, str], cwd: Path, prompt: str, *flags: str) -> dict[str, Any]:
    """`claude -p prompt --output-format json` against the fleet, in `cwd` with a throwaway HOME;
    its JSON result. `--max-turns` bounds a loop that would not end."""
    f, key = fleet
    home = cwd.parent / f"{cwd.name}-home"
    home.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": f.base_url,
        "ANTHROPIC_API_KEY": key,
        # Its background model (titles, summaries) is a tier too: every call it makes goes to the fleet.
        "ANTHROPIC_SMALL_FAST_MODEL": TIER,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": TIER,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "API_TIMEOUT_MS": "60000",
    }
    got = subprocess.run(
        [str(claude), "-p", prompt, "--output-format", "json", "--model", TIER, "--max-turns", "3", *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, f"claude exited {got.returncode}: {got.stdout[-2000:]} {got.stderr[-2000:]}"
    result: dict[str, Any] = orjson.loads(got.stdout)
    return result


def test_plain_prompt_runs_to_a_clean_result(claude: Path, keyed: tuple[Fleet, str], tmp_path: Path) -> None:
    """No tools offered (`--tools ""`): one turn, the sim's text as the result."""
    work = tmp_path / "work"
    work.mkdir()
    out = run_claude(claude, keyed, work, "Say hi.", "--tools", "")
    assert out["type"] == "result" and out["subtype"] == "success", out
    assert out["is_error"] is False and out["num_turns"] == 1, out
    assert isinstance(out["result"], str) and out["result"].strip(), out
    assert out["usage"]["input_tokens"] > 0 and out["usage"]["output_tokens"] > 0, out
    assert httpx.head(f"{keyed[0].base_url}/").status_code == 200  # its first request, sent without a key


def test_its_default_request_is_served(claude: Path, keyed: tuple[Fleet, str], tmp_path: Path) -> None:
    """Its default tool set (24 tools in JSON Schema 2020-12, a first request of ~77 KB), with
    `--permission-mode dontAsk`, so no tool that asks leave runs: the sim calls the first tool
    offered, Claude Code answers it (in this version, an Agent that does not exist: an error
    result) and the fleet's final text quotes that result. Two turns, a clean result."""
    work = tmp_path / "work"
    work.mkdir()
    out = run_claude(claude, keyed, work, "Say hi.", "--permission-mode", "dontAsk")
    assert out["type"] == "result" and out["subtype"] == "success", out
    assert out["is_error"] is False and out["num_turns"] == 2, out
    assert out["result"].startswith("The tool said: "), out
    assert out["usage"]["input_tokens"] > 10_000, out  # the default system prompt and tools, counted by the fleet


def test_a_tool_is_run_and_its_result_answered(claude: Path, keyed: tuple[Fleet, str], tmp_path: Path) -> None:
    """Write alone offered and allowed, in a throwaway directory: the sim calls it with input made
    from its schema (file_path and content "sim"), Claude Code runs it (the file is there), sends
    its tool_result back, and the fleet's final text quotes that result: only a tool_result that
    reached the fleet gives "The tool said: File created ...". Two turns, a clean result."""
    work = tmp_path / "work"
    work.mkdir()
    out = run_claude(claude, keyed, work, "Write the file sim.", "--tools", "Write", "--allowedTools", "Write")
    assert out["type"] == "result" and out["subtype"] == "success", out
    assert out["is_error"] is False and out["num_turns"] == 2, out
    assert (work / "sim").read_text() == "sim"  # the tool_use was run
    assert out["result"].startswith("The tool said: File created successfully"), out
    assert out["permission_denials"] == [], out
