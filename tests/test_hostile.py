"""What a hostile client (or a hostile upstream) sends never runs in the operator's browser: every value /ui shows
is a client's, an upstream's or a file's, and each is drawn as text, under a Content-Security-Policy that refuses
anything inline (Debian's Chromium, driven by Playwright)."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from servers import raw_upstream
from test_waterfall import CHROMIUM_ARGS, hold_still, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Each payload, parsed as markup, would record its field in window.__ran (the init script below makes the list).
RAN = "window.__ran.push"
PAYLOADS = {
    "model": f"<img src=x onerror=\"{RAN}('model')\">",
    "user": f"<img/src=x/onerror={RAN}(`user`)>",  # (an end user is printable ASCII, its spaces replaced: tenants.clean)
    "tenant": f"<svg/onload={RAN}(`tenant`)>",  # (a `values: any` header: the client names its tenant)
    "upstream": f"<img src=x onerror=\"{RAN}('upstream')\">",  # (the routes file's: an operator's, drawn as text all the same)
    "instance": f"\"><img src=x onerror={RAN}(`instance`)>",
    "response_model": f"<img src=y onerror={RAN}(`response_model`)>",  # (the upstream's)
    "error": f"<img src=z onerror={RAN}(`error`)>",  # (an upstream's stream error code)
}
WATCH = """
window.__ran = [];
window.__violations = [];
document.addEventListener("securitypolicyviolation", (e) => window.__violations.push(e.violatedDirective));
"""


def chat_stream(model: str) -> list[bytes]:
    chunk = b'data: {"id":"x","object":"chat.completion.chunk","model":"%s","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    return [chunk % model.replace('"', '\\"').encode(), b"data: [DONE]\n\n"]


def failed_response(code: str) -> list[bytes]:
    return [b'event: response.created\ndata: {"type":"response.created","response":{"id":"r","model":"err"}}\n\n',
            b'event: response.failed\ndata: {"type":"response.failed","response":{"id":"r","error":{"code":"%s","message":"no"}}}\n\n'
            % code.encode()]


def browser_page(p, url: str):
    browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.add_init_script(WATCH)  # (the DevTools protocol's: before the page's own script, outside its policy)
    page = context.new_page()
    page.goto(url)
    return browser, context, page


def test_every_client_value_is_text_in_the_page(sim, proxy_factory, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - header: {name: x-tenant, values: any}\nusers:\n  header: x-end-user\n")
    with raw_upstream(chat_stream(PAYLOADS["response_model"])) as rm, raw_upstream(failed_response(PAYLOADS["error"])) as err:
        routes = tmp_path / "routes.yaml"
        routes.write_text(f"upstreams:\n  - {{name: {json.dumps(PAYLOADS['upstream'])}, url: {sim.url}/v1}}\n  - {{name: rm, url: {rm.url}}}\n"
                          f"  - {{name: err, url: {err.url}}}\nroutes:\n  - {{models: [rm], upstreams: [rm]}}\n"
                          f"  - {{models: [err], upstreams: [err]}}\n  - {{models: ['*'], upstreams: [{json.dumps(PAYLOADS['upstream'])}]}}\n")
        proxy = proxy_factory(routes=str(routes), tenants=str(tenants), instance=PAYLOADS["instance"])
        who = {"x-tenant": PAYLOADS["tenant"], "x-end-user": PAYLOADS["user"]}
        with httpx.Client(base_url=proxy.v1, timeout=30, headers=who) as client:
            client.post("/chat/completions", json={"model": PAYLOADS["model"], "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 3, "stream": True})
            client.post("/chat/completions", json={"model": "rm", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            client.post("/responses", json={"model": "err", "input": "hi", "stream": True})
            # A 429 asking for 30 s of quiet: the replica (its name a payload) is set aside, and the replicas line says so.
            client.post("/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                        headers={"x-sim-error-status": "429", "x-sim-retry-after": "30"})
        records = proxy.wait_records(4)
        assert {r["model"] for r in records} == {PAYLOADS["model"], "rm", "err", "m"}
        assert [r["error"] for r in records if r["model"] == "err"] == [f"stream_error:{PAYLOADS['error']}"]
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser, context, page = browser_page(p, f"{proxy.url}/ui")
            try:
                response = page.request.get(f"{proxy.url}/ui")
                policy = response.headers["content-security-policy"]
                assert "script-src 'self'" in policy and "default-src 'none'" in policy and "unsafe-inline" not in policy
                wait_for(page, "document.body.dataset.loaded === 'true' && document.querySelectorAll('.row').length === 4")
                wait_for(page, "document.querySelector('#replicas .aside') !== null")
                hold_still(page)
                shown = page.inner_text("body")
                for field in ("model", "upstream"):
                    assert PAYLOADS[field] in shown, field  # (the row label; the replicas line)
                for field in ("model", "upstream", "instance", "tenant"):  # each filter offers the value as an option's text
                    assert PAYLOADS[field] in page.eval_on_selector_all(f"#{field} option", "os => os.map(o => o.textContent)"), field
                for index in range(4):  # every record's detail view
                    page.locator(".row").nth(index).click()
                    detail = page.inner_text("#detail")
                    record = next(r for r in records if f"{r['model']} openai" in detail.splitlines()[0])
                    for field, value in (("user", PAYLOADS["user"]), ("tenant", PAYLOADS["tenant"]), ("instance", PAYLOADS["instance"])):
                        assert value in detail, (field, detail)
                    if record["model"] == "rm":
                        assert PAYLOADS["response_model"] in detail
                    if record["model"] == "err":
                        assert PAYLOADS["error"] in detail
                    if record["model"] == PAYLOADS["model"]:
                        assert PAYLOADS["upstream"] in detail  # (its attempts: the replica that served it)
                assert page.evaluate("window.__ran") == [] and page.evaluate("window.__violations") == [], "a value was parsed as markup"
                # A miss elsewhere still cannot run: markup put in the page by hand, its handler refused by the policy.
                page.evaluate(f"document.body.insertAdjacentHTML('beforeend', '<img src=q onerror=\"{RAN}(1)\">')")
                wait_for(page, "window.__violations.length > 0")
                assert page.evaluate("window.__ran") == [] and "script-src-attr" in page.evaluate("window.__violations")[0]
            finally:
                browser.close()


def test_the_admin_key_is_out_of_any_scripts_reach(sim, proxy_factory):
    proxy = proxy_factory(admin_key="admin-secret-7e1")
    httpx.post(f"{proxy.v1}/chat/completions", json={"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
               timeout=30)
    assert httpx.get(f"{proxy.url}/llmproxy/ui/waterfall.js").status_code == 200  # (the page's files hold no data)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, context, page = browser_page(p, f"{proxy.url}/ui?api=openai")
        try:
            page.wait_for_selector("#login:not([hidden])")
            page.fill("#key", "wrong")
            page.click("#login button")
            page.wait_for_selector("#refused:not([hidden])")
            page.fill("#key", "admin-secret-7e1")
            page.click("#login button")
            wait_for(page, "document.querySelectorAll('.row').length === 1")
            assert page.input_value("#api") == "openai"  # (back to the same view)
            cookie = next(c for c in context.cookies() if c["name"] == "llmproxy_ui")
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and "admin-secret" not in cookie["value"]
            # What a script in the page can reach: no cookie, no storage, no key in the page or its script's state.
            assert page.evaluate("document.cookie") == ""
            assert page.evaluate("sessionStorage.length + localStorage.length") == 0
            assert "admin-secret" not in page.content() and "admin-secret" not in page.evaluate("JSON.stringify(state)")
            # The cookie opens the data endpoints; a forged one does not.
            assert httpx.get(f"{proxy.url}/llmproxy/requests", cookies={"llmproxy_ui": cookie["value"]}).status_code == 200
            assert httpx.get(f"{proxy.url}/llmproxy/requests", cookies={"llmproxy_ui": "admin-secret-7e1"}).status_code == 401
        finally:
            browser.close()
