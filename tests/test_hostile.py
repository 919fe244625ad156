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
            # A 503 asking for 30 s of quiet: the replica (its name a payload) is set aside, and the replicas line says so.
            client.post("/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                        headers={"x-sim-error-status": "503", "x-sim-retry-after": "30"})
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
    # The login form is open to anyone: a body past its size is refused, a body of many fields or another place to go
    # back to is a refusal that leads back to the page only.
    assert httpx.post(f"{proxy.url}/llmproxy/login", content=b"key=" + b"x" * 100_000).status_code == 413
    for body, place, cookie in (("&".join(f"f{i}=1" for i in range(50)), "/ui#refused", False),
                                ("key=admin-secret-7e1&back=//evil.example/x", "/ui", True),
                                ("key=nope&back=?a%0d%0aSet-Cookie:x=1", "/ui#refused", False)):
        answer = httpx.post(f"{proxy.url}/llmproxy/login", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
        assert (answer.status_code, answer.headers["location"], "set-cookie" in answer.headers) == (303, place, cookie), body
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


def corpus() -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers) a hostile or broken client sends: legal JSON an engine rejects or truncates cheaply, and
    what no JSON parser takes. The large ones are answered 400 by the simulator before it parses them (an engine
    refusing an over-long prompt)."""
    import orjson

    refuse = {"x-sim-error-status": "400"}
    markup = "<img src=x onerror=window.__ran.push(`corpus`)>"
    long = "<b>" + "x" * 20_000
    chat = b"/v1/chat/completions"
    image = "data:image/png;base64," + "iVBORw0KGgo" * 100_000
    out = [
        ("/v1/completions", orjson.dumps({"model": "sim-7b", "prompt": [7] * 450_000, "max_tokens": 1}), refuse),
        ("/v1/chat/completions", orjson.dumps({"model": "sim-7b", "messages": [{"role": "user", "content": ""}] * 60_000}), refuse),
        ("/v1/completions", orjson.dumps({"model": "sim-7b", "prompt": [[3]] * 200_000, "max_tokens": 1}), refuse),
        ("/v1/chat/completions", orjson.dumps({"model": long, "user": long, "messages": [{"role": "user", "content": long}], "max_tokens": 2}), {}),
        ("/v1/chat/completions", b'{"model": "sim-7b", "messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}", {}),
        ("/v1/chat/completions", b'{"model": "huge", "max_tokens": 2, "n": 1, "seed": 123456789012345678901234567890, "temperature": NaN, '
                                 b'"top_p": 1e400, "messages": [{"role": "user", "content": "hi"}]}', {}),
        ("/v1/chat/completions", b'{"model": "bad-\xff\xfe-utf8", "messages": [{"role": "user", "content": "hi \xc3"}]}', {}),
        ("/v1/chat/completions", orjson.dumps({"model": markup, "user": markup, "max_tokens": 2, "stream": True,
                                               "messages": [{"role": "user", "content": markup, "name": markup}],
                                               "tools": [{"type": "function", "function": {"name": markup, "parameters": {}}}]}),
         {"x-end-user": markup}),
        ("/v1/chat/completions", b'{"model": "surrogate-\\ud800", "user": "u-\\udfff", "stream": true, "max_tokens": 2, '
                                 b'"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', {}),
        ("/v1/chat/completions", orjson.dumps({"model": "sim-7b", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": image}}]}]}), {}),
        ("/v1/chat/completions", b"[1, 2, 3]", {}),
        ("/v1/chat/completions", b'"just a string"', {}),
        ("/v1/chat/completions", b"null", {}),
        ("/v1/chat/completions", b"   ", {}),
        ("/v1/chat/completions", orjson.dumps({"model": ["a", "list"] * 1000, "messages": [{"role": "user", "content": "hi"}]}), {}),
        ("/v1/chat/completions", orjson.dumps({"model": {"a": 1}, "messages": {"role": "user"}, "stream": "yes"}), {}),
        ("/v1/messages", orjson.dumps({"model": markup, "max_tokens": 2, "system": [{"type": "text", "text": markup}],
                                       "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": image}}]}]}), {}),
        ("/v1/responses", orjson.dumps({"model": "sim-7b", "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}] * 5000,
                                        "max_output_tokens": 2}), {}),
    ]
    assert chat  # (the paths above are the APIs' own)
    return out


def test_a_corpus_of_hostile_bodies_through_the_proxy_to_the_store_the_metrics_and_the_page(sim, proxy_factory, tmp_path):
    """Every body of the corpus, through a proxy that indexes every prompt (a route placed by prefix cache): each gets
    an answer (the upstream's, or the proxy's own error in OpenAI's shape), has its record, every stored string
    storable; telemetry never failed; the scrape parses; the page draws every record as text; and an ordinary
    request is served as before, afterwards."""
    import orjson
    from prometheus_client.parser import text_string_to_metric_families

    routes = tmp_path / "routes.yaml"
    routes.write_text(f"upstreams:\n  - {{name: a, url: {sim.url}/v1}}\n  - {{name: b, url: {sim.url}/v1}}\n"
                      "routes:\n  - {models: ['*'], upstreams: [a, b], pick: predicted_ttft}\n")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - header: {name: x-tenant, values: any}\nusers:\n  header: x-end-user\n")
    proxy = proxy_factory(routes=str(routes), tenants=str(tenants))
    sent = corpus()
    with httpx.Client(base_url=proxy.url, timeout=60) as client:
        for path, body, headers in sent:
            fast = {"x-sim-ttft-ms": "0", "x-sim-decode-tps": "2000"}  # (the simulated engine's time is not what is tested)
            response = client.post(path, content=body, headers={"content-type": "application/json", "x-tenant": "<i>t</i>", **fast, **headers})
            assert response.status_code < 500 or response.json()["error"]["message"], (path, body[:80], response.status_code, response.text[:200])
        ok = client.post("/v1/chat/completions", json={"model": "sim-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    records = proxy.wait_records(len(sent) + 1, timeout=30)
    assert len(records) == len(sent) + 1
    for record in records:
        for value in (record["model"], record.get("user") or "", record.get("tenant") or "", record.get("response_model") or ""):
            assert len(value) <= 256 and not any(0xD800 <= ord(c) <= 0xDFFF or ord(c) < 0x20 for c in value), value[:80]
    by_model = {r["model"]: r for r in records}
    assert "surrogate-\ufffd" in by_model and by_model["surrogate-\ufffd"]["user"] == "u-_"  # (kept, made storable: not `unknown`)
    assert by_model["surrogate-\ufffd"]["prompt_tokens"] and by_model["huge"]["outcome"] == "ok"
    assert ("<b>" + "x" * 253) in by_model  # (a 20,000-character model: its first 256 characters)
    scrape = httpx.get(f"{proxy.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(scrape)}
    errors = {s.labels["component"]: s.value for s in families["llmproxy_telemetry_errors"].samples if s.name.endswith("_total")}
    assert not any(errors.values()), errors
    assert "\x00" not in scrape and "\ud800" not in scrape
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, context, page = browser_page(p, f"{proxy.url}/ui")
        try:
            wait_for(page, f"document.querySelectorAll('.row').length === {len(records)}")
            hold_still(page)
            for index in range(len(records)):
                page.locator(".row").nth(index).click()
            assert page.evaluate("window.__ran") == [] and page.evaluate("window.__violations") == []
        finally:
            browser.close()
    assert orjson.loads(httpx.get(f"{proxy.url}/llmproxy/requests", params={"model": "huge"}).content)[0]["model"] == "huge"
