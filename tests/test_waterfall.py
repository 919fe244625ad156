"""The live waterfall page (/ui) in a real headless Chromium (Debian's, driven by Playwright):
one bar per request, each phase segment as wide as the record says, a tick per content chunk."""
from __future__ import annotations

import shutil
import time

import httpx
import pytest

from servers import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ARTIFACT = ROOT / "test-artifacts" / "waterfall.png"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def wait_for(page, expression: str, timeout: float = 15.0) -> None:
    """Until `expression` is true in the page. Playwright's own wait_for_function evaluates its predicate with the
    page's eval, which the page's Content-Security-Policy refuses (as it should); page.evaluate goes through the
    DevTools protocol, which the policy does not govern."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {expression}")
        time.sleep(0.05)


def hold_still(page) -> None:
    """Stop the page's live redraw (every 2 s; a filter's change still redraws): handles taken across
    a redraw are detached from the page, and a check would fail on the test, not on the page."""
    page.uncheck("#live")


def test_the_waterfall_matches_the_records(proxy_factory, tmp_path):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "chromium missing: run `make test` (it installs Debian's chromium package)"
    objectives = tmp_path / "slo.yaml"  # the 2,000-token prompt (400 ms of prefill) misses TTFT; the 500 is an error
    objectives.write_text("objectives:\n  - name: chat\n    models: [sim-7b]\n    ttft: 0.3\n    tpot: 0.05\n    target: 0.99\n")
    tenants = tmp_path / "tenants.yaml"  # (a team behind its own gateway, known by a header; end users by another)
    tenants.write_text("tenants:\n  - name: mobile\n    header: {name: x-team, values: [mobile]}\nusers:\n  header: x-end-user\n")
    proxy = proxy_factory(records_db=str(tmp_path / "records.sqlite"), slo=str(objectives), tenants=str(tenants))
    with httpx.Client(base_url=proxy.v1, timeout=30) as client:
        for tokens, prompt, headers in ((20, 200, {}), (40, 2000, {"x-sim-decode-tps": "80"}), (10, 50, {"x-sim-hidden-reasoning": "15"}),
                                        (30, 800, {"x-sim-chunk-pattern": "3,1"}), (5, 100, {"x-sim-error-status": "500"})):
            body = {"model": "sim-7b", "messages": [{"role": "user", "content": " the" * prompt}], "max_tokens": tokens, "stream": True}
            client.post("/chat/completions", json=body, headers=headers)
        client.post("/responses", json={"model": "sim-7b", "input": "hi", "max_output_tokens": 12, "stream": True})
        client.post("/messages", json={"model": "claude-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True})
    httpx.post(f"{proxy.url}/api/chat", json={"model": "laptop", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 6}},
               headers={"x-sim-load-ms": "200"}, timeout=30)  # Ollama's cold model load: its own segment
    records = proxy.wait_records(8)
    assert len(records) == 8 and "load" in records[-1]["phases_s"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 700})
            page.goto(f"{proxy.url}/ui")
            page.wait_for_selector("body[data-loaded=true]")
            hold_still(page)
            px_per_s = float(page.get_attribute("#rows", "data-px-per-s") or 0)
            rows = page.query_selector_all(".row")
            assert len(rows) == len(records) and px_per_s > 0
            worst = 0.0
            for row, record in zip(rows, reversed(records)):  # newest first
                segments = row.query_selector_all(".seg")
                drawn = {s.get_attribute("data-phase") for s in segments}
                # every phase wider than the 0.001 px a width is written with (the page's MIN_PX)
                assert drawn == {p for p, v in record["phases_s"].items() if v * px_per_s >= 0.0005}, record["phases_s"]
                for segment in segments:
                    box = segment.bounding_box()
                    assert box is not None
                    error = abs(box["width"] - record["phases_s"][segment.get_attribute("data-phase")] * px_per_s)
                    worst = max(worst, error)
            assert worst <= 1.0, f"a segment is {worst:.2f} px off its record"
            streamed = next(i for i, r in enumerate(reversed(records)) if r["endpoint"] == "chat" and r["content_chunks"] == 40)
            rows[streamed].click()
            page.wait_for_selector("#detail .tick")
            assert len(page.query_selector_all("#detail .tick")) == 40
            page.select_option("#api", "anthropic")  # one API alone: the Anthropic request, its 9 ticks
            wait_for(page, "document.querySelectorAll('.row').length === 1")
            assert "anthropic messages" in page.inner_text(".row .label")
            page.locator(".row").first.click()
            wait_for(page, "document.querySelectorAll('#detail .tick').length === 9")
            page.check("#live")  # (live again: the browser's own request below must come in)
            page.select_option("#api", "")
            everything = len(proxy.records())  # (by now also the browser's own GET /favicon.ico: relayed like any path)
            wait_for(page, f"document.querySelectorAll('.row').length === {everything}")
            ARTIFACT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACT), full_page=True)
            # An alert's first_look link (/ui?outcome=...&upstream=...) opens the page filtered so
            # (api too: the browser's own /favicon.ico, relayed, is an upstream error of api other).
            failed = [r for r in proxy.records() if r["outcome"] == "upstream_error" and r["api"] == "openai"]
            page.goto(f"{proxy.url}/ui?outcome=upstream_error&api=openai&upstream={failed[0]['upstream']}")
            page.wait_for_selector("body[data-loaded=true]")
            wait_for(page, "document.querySelectorAll('.row').length === 1")
            assert len(failed) == 1 and page.input_value("#outcome") == "upstream_error" and page.input_value("#api") == "openai"
            assert page.input_value("#upstream") == failed[0]["upstream"]
            # The misses of an SLO (a burn alert's first_look link): each row marked with what it missed and why.
            missed = [r for r in proxy.records() if r.get("slo_good") is False]
            assert [(r["slo_missed"], r["slo_blame"]) for r in missed] == [(["ttft"], {"ttft": "prefill"}), (["error"], {"error": "upstream_error"})]
            page.goto(f"{proxy.url}/ui?slo=chat&verdict=miss")
            page.wait_for_selector("body[data-loaded=true]")
            wait_for(page, "document.querySelectorAll('.row.missed').length === 2")
            hold_still(page)
            assert len(page.query_selector_all(".row")) == 2 and page.input_value("#verdict") == "miss"
            assert [m.inner_text() for m in page.query_selector_all(".row .miss")] == ["✗ error: upstream_error", "✗ ttft: prefill"]
            page.locator(".row").nth(1).click()
            wait_for(page, "document.querySelector('#detail').innerText.includes('chat: missed ttft: prefill')")
            page.select_option("#verdict", "good")
            wait_for(page, "document.querySelectorAll('.row').length > 0 && document.querySelectorAll('.row.missed').length === 0")
            assert len(page.query_selector_all(".row")) == sum(1 for r in proxy.records() if r.get("slo_good") is True)
            # The summary line: the store's counts for the same filters, not the rows on the page.
            good = sum(1 for r in proxy.records() if r.get("slo_good") is True)
            wait_for(page, f"document.querySelector('#summary').dataset.requests === '{good}'")
            assert f"{good} requests (ok {good})" in page.inner_text("#summary") and "SLO chat 100.00% of" in page.inner_text("#summary")
            page.select_option("#verdict", "")
            judged = sum(1 for r in proxy.records() if r.get("slo") == "chat")  # (the page's slo filter is still chat)
            wait_for(page, f"document.querySelector('#summary').dataset.requests === '{judged}'")
            assert f"SLO chat {100 * good / judged:.2f}% of {judged}" in page.inner_text("#summary")
            # A TTFT threshold: only the requests whose first token took that long (the 2,000-token prompt's 400 ms prefill).
            slow = [r for r in proxy.records() if (r.get("ttft_s") or 0) >= 0.35 and r.get("slo") == "chat"]
            page.fill("#min_ttft", "0.35")
            page.dispatch_event("#min_ttft", "change")
            wait_for(page, f"document.querySelectorAll('.row').length === {len(slow)}")
            assert len(slow) == 1 and slow[0]["prompt_tokens"] > 1900
            # Who sent it: one tenant's requests, then one end user's (typed: there are many).
            known = len(proxy.records())
            for user in ("u-7", "u-8"):
                httpx.post(f"{proxy.v1}/chat/completions", json={"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                           headers={"x-team": "mobile", "x-end-user": user}, timeout=30)
            assert len(proxy.wait_records(known + 2)) == known + 2  # (counted before they were sent: none waited for in vain)
            page.goto(f"{proxy.url}/ui?tenant=mobile")
            page.wait_for_selector("body[data-loaded=true]")
            wait_for(page, "document.querySelectorAll('.row').length === 2")
            assert page.input_value("#tenant") == "mobile"
            page.fill("#user", "u-7")
            page.dispatch_event("#user", "change")
            wait_for(page, "document.querySelectorAll('.row').length === 1")
            page.locator(".row").first.click()
            wait_for(page, "document.querySelector('#detail').innerText.includes('mobile, end user u-7')")
            # The replicas line: each replica's health now. A 503 asking for 30 s of quiet sets this one aside
            # (alone on its route, it still serves: one always does).
            assert page.inner_text("#replicas") == f"replicas: {proxy.settings.upstream_label} serving"
            httpx.post(f"{proxy.v1}/chat/completions", json={"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                       headers={"x-sim-error-status": "503", "x-sim-retry-after": "30"}, timeout=30)
            page.wait_for_selector("#replicas .aside")
            line = page.inner_text("#replicas")
            assert line.startswith(f"replicas: {proxy.settings.upstream_label} ejected (retry after, back in ") and line.endswith(" s)"), line
            assert 25 <= float(line.rsplit("back in ", 1)[1][:-3]) <= 30
        finally:
            browser.close()
    print(f"\n{len(rows)} bars, worst segment {worst:.3f} px off its record; screenshot {ARTIFACT}")
