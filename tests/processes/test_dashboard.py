"""GET /dashboard in a real headless Chromium: it loads, shows each tier, and its numbers move with load."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.harness import Fleet

TIERS = ("routing", "analysis", "planner")
CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and os.path.exists(p)), None)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make chromium)")


@pytest.fixture
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def chat(f: Fleet, tier: str, deadline_ms: int = 20000) -> None:
    httpx.post(f"{f.base_url}/v1/chat/completions", timeout=30,
               headers={"x-priority": "background", "x-deadline-ms": str(deadline_ms)},
               json={"model": tier, "messages": [{"role": "user", "content": "digest the tape"}], "max_tokens": 6})


def test_dashboard_shows_each_tier_and_follows_load(fleet: Fleet, browser) -> None:  # type: ignore[no-untyped-def]
    fleet.start_gateway()
    fleet.start_worker("routing")  # planner gets no replica: its line can only grow
    page = browser.new_page()
    requests: list[str] = []
    problems: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))

    resp = page.goto(f"{fleet.base_url}/dashboard")
    assert resp is not None and resp.status == 200
    for tier in TIERS:
        page.wait_for_selector(f'section.tier[data-tier="{tier}"]', timeout=15000)
        assert page.text_content(f'section.tier[data-tier="{tier}"] h2 .name') == tier
    # Predicates as functions: the page's CSP forbids eval, which a bare expression would need.
    page.wait_for_function("() => Number(document.body.dataset.updates || 0) >= 2", timeout=15000)

    def field(tier: str, name: str) -> str:
        return page.text_content(f'section.tier[data-tier="{tier}"] [data-field="{name}"]') or ""

    assert field("routing", "accepted") == "0"
    assert field("planner", "line") == "0"
    assert field("routing", "replicas") == "0 / 1 / 0"
    assert field("planner", "bounds") == "1 / 2"
    # The planner's scheduled pre-warm (ready by 03:00 on 1 January): the floor it raises and when
    # the scaler plans to start it, before its ready time; routing has none.
    prewarm = field("planner", "prewarm")
    assert prewarm.startswith("floor 2 ready by ") and ", starts " in prewarm, prewarm
    assert field("routing", "prewarm") == "—"
    # The routing replica's cold start (median of its phases) beside the model and its error; the planner has none.
    cold = field("routing", "coldstart")
    assert " (model 0.20, " in cold, cold
    assert field("planner", "coldstart") == "—"

    # Load arrives: 12 calls the routing replica serves, 3 that wait in the planner's line.
    load = [threading.Thread(target=chat, args=(fleet, "routing")) for _ in range(12)]
    load += [threading.Thread(target=chat, args=(fleet, "planner", 8000)) for _ in range(3)]
    for t in load:
        t.start()
    try:
        sel = 'section.tier[data-tier="{}"] [data-field="{}"]'
        page.wait_for_function(f"() => Number(document.querySelector('{sel.format('routing', 'completed')}')"
                               f".textContent) >= 12", timeout=20000)
        page.wait_for_function(f"() => document.querySelector('{sel.format('planner', 'line')}').textContent === '3'",
                               timeout=20000)
        assert float(field("routing", "arrival")) > 0
        assert field("planner", "drain") == "∞"  # a line that nothing serves
        # The line chart drew something for the planner.
        painted = page.evaluate("""() => {
            const c = document.querySelector('section.tier[data-tier="planner"] canvas[data-chart="line"]');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }""")
        assert painted > 50
    finally:
        for t in load:
            t.join(30)

    # Self-contained: the browser fetched nothing but the gateway.
    assert requests and all(u.startswith(fleet.base_url) for u in requests), requests
    assert not problems, problems
