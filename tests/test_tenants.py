"""Who sent a request (proxy/serve/tenants.py): the file, the fingerprints, the sources in their order."""
import hashlib
import os
import subprocess
import sys
import time

import pytest

from proxy.serve.tenants import DYNAMIC_MAX, Tenants, api_user, fingerprint, parse

KEY_A, KEY_B = "sk-search-0123456789abcdef", "sk-batch-fedcba9876543210"
FILE = f"""
tenants:
  - name: search
    keys: ["{fingerprint(KEY_A)}"]
  - name: batch
    keys: ["{fingerprint(KEY_B)[7:]}"]        # (the prefix `sha256:` is optional)
    header: {{name: x-team, values: [batch, batch-eu]}}
  - header: {{name: X-Tenant, values: any}}
users:
  header: x-end-user
"""


def tenants(text: str = FILE) -> Tenants:
    return Tenants(config=parse(text))


def h(**headers: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]


def test_fingerprint_is_a_prefix_of_the_keys_sha256_and_the_command_prints_it():
    assert fingerprint(KEY_A) == "sha256:" + hashlib.sha256(KEY_A.encode()).hexdigest()[:16]
    done = subprocess.run([sys.executable, "-m", "proxy", "tenants", "fingerprint"], input=f"{KEY_A}\nBearer {KEY_B}\n",
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == [fingerprint(KEY_A), fingerprint(KEY_B)]
    assert KEY_A not in done.stdout + done.stderr and KEY_B not in done.stdout + done.stderr


def test_each_key_header_of_every_api_names_its_tenant():
    t = tenants()
    for headers in (h(authorization=f"Bearer {KEY_A}"), h(x_api_key=KEY_A), h(api_key=KEY_A), h(x_goog_api_key=KEY_A)):
        assert t.tenant(headers) == "search", headers
    assert t.tenant([], b"alt=sse&key=" + KEY_A.encode()) == "search"  # Gemini's query parameter
    assert t.tenant(h(authorization=f"Bearer {KEY_B}")) == "batch"


def test_sources_in_order_and_the_rest_unknown():
    t = tenants()
    assert t.tenant(h(authorization=f"Bearer {KEY_A}", x_team="batch")) == "search"  # the key first
    assert t.tenant(h(authorization="Bearer sk-unknown", x_team="batch-eu")) == "batch"  # an unknown key: the next source
    assert t.tenant(h(x_team="nope")) == "unknown"  # a value not listed
    assert t.tenant(h(x_tenant="ads team\x07")) == "ads_team_"  # any value, sanitised
    assert t.tenant(h(x_tenant="x" * 500)) == "x" * 64
    assert t.tenant([]) == "unknown"
    assert t.label("search") == "search" and t.label("ads_team_") == "other" and t.label("unknown") == "unknown"


def test_dynamic_tenants_are_bounded():
    t = tenants()
    for i in range(DYNAMIC_MAX):
        assert t.tenant(h(x_tenant=f"t{i}")) == f"t{i}"
    assert t.tenant(h(x_tenant="one-more")) == "other"
    assert t.tenant(h(x_tenant="t5")) == "t5"  # one seen before keeps its name


def test_the_end_user_from_the_header_then_the_apis_own_fields():
    t = tenants()
    assert t.user(h(x_end_user="u-1"), {"user": "u-2"}) == "u-1"
    assert t.user([], {"user": "u-2"}) == "u-2"
    assert api_user({"safety_identifier": "hashed-9", "user": "u-2"}) == "hashed-9"
    assert api_user({"metadata": {"user_id": "claude-user"}}) == "claude-user"  # Anthropic's, and OpenAI's metadata
    assert api_user({"metadata": {"other": 1}, "user": 5}) == "" and api_user(None) == ""
    assert t.user([], {"user": "é\n" + "u" * 300}) == "__" + "u" * 126


@pytest.mark.parametrize("text, message", [
    ("tenants:\n  - name: a\n    keys: [sk-live-secret-key]\n", "line 2: keys entry 1 is not a fingerprint"),
    ("tenants:\n  - name: a\n    kyes: [abc]\n", "line 2: tenant has unknown keys ['kyes']"),
    ("tenants:\n  - name: other\n    header: {name: x, values: any}\n", "line 2: name must be"),
    ("tenants:\n  - keys: ['sha256:0123456789abcdef']\n", "line 2: a tenant with `keys` needs a `name`"),
    ("tenants:\n  - name: a\n    keys: ['0123456789abcdef']\n  - name: b\n    keys: ['0123456789ab']\n", "line 4: fingerprint '0123456789ab' also matches tenant 'a'"),
    ("tenants:\n  - name: a\n    header: {name: x, values: some}\n", "line 2: header values must be"),
    ("tenants: [\n", "line 2"),
    ("users: {cookie: x}\n", "users must be"),
])
def test_a_broken_file_is_refused_with_its_line(text, message):
    with pytest.raises(ValueError) as err:
        parse(text, "t.yaml")
    assert message in str(err.value) and "t.yaml" in str(err.value)
    assert "sk-live-secret-key" not in str(err.value)  # a key pasted by mistake is never echoed


def test_reload_keeps_the_old_file_when_the_new_one_is_broken(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    t = Tenants(str(path))
    path.write_text("tenants:\n  - name: search\n    keys: [nope]\n")
    with pytest.raises(ValueError):
        t.reload()
    assert t.tenant(h(authorization=f"Bearer {KEY_A}")) == "search"
    path.write_text(f"tenants:\n  - name: renamed\n    keys: ['{fingerprint(KEY_A)}']\n")
    t.reload()
    assert t.tenant(h(authorization=f"Bearer {KEY_A}")) == "renamed"


# End to end: three applications known only by their keys and one by a header, 4,000 end users.
APPS = {"search": "sk-app-search-1111111111", "chat": "sk-app-chat-2222222222", "agents": "sk-app-agents-3333333333"}
GATEWAY_KEY = "sk-app-gateway-4444444444"  # the batch team's gateway: a key the tenants file does not name, and a header
USERS = 4_000
FAST = {"x-sim-ttft-ms": "0", "x-sim-decode-tps": "100000"}


def sent_by(i: int) -> tuple[str, str]:
    """Request i's (tenant, key)."""
    tenant = ("search", "chat", "agents", "batch")[i % 4]
    return tenant, APPS.get(tenant, GATEWAY_KEY)


@pytest.mark.e2e
def test_every_request_attributed_to_its_tenant_and_user_and_no_key_anywhere(proxy_factory, tmp_path, caplog):
    import asyncio
    import collections
    import logging
    import re
    import sqlite3

    import anthropic
    import httpx
    import openai

    from proxy.answers import ledger
    from proxy.records import open_backend

    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n" + "".join(f"  - name: {name}\n    keys: ['{fingerprint(key)}']\n" for name, key in APPS.items())
                    + "  - name: batch\n    header: {name: x-team, values: [batch]}\nusers:\n  header: x-end-user\n")
    objectives = tmp_path / "slo.yaml"
    objectives.write_text("objectives:\n  - name: everyone\n    tenants: ['*']\n    ttft: 30\n    e2e: 60\n    target: 0.99\n")
    keys = [*APPS.values(), GATEWAY_KEY]
    proxy = proxy_factory(tenants=str(path), slo=str(objectives), api_key=",".join(keys), log_requests=True, tokenize=False)
    caplog.set_level(logging.INFO, logger="llmproxy")

    async def traffic() -> None:
        # One connection pool per API, each application's client on it with its own key (a pool per key would leave
        # connections idle past the server's keep-alive while the others are busy, and a reuse racing its close fails).
        base = openai.AsyncOpenAI(base_url=proxy.v1, api_key=keys[0], max_retries=0)
        clients = {key: base.with_options(api_key=key) for key in keys}
        claude_base = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=keys[0], max_retries=0)
        claudes = {key: claude_base.with_options(api_key=key) for key in keys}
        semaphore = asyncio.Semaphore(24)

        async def one(i: int) -> None:
            tenant, key = sent_by(i)
            user = f"{tenant}-u{i}"
            headers = {**FAST, **({"x-team": "batch"} if tenant == "batch" else {})}
            async with semaphore:
                if i % 3 == 0:  # Anthropic's own field
                    await claudes[key].messages.create(model="sim-7b", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                                       metadata={"user_id": user}, extra_headers=headers)
                elif i % 3 == 1:  # OpenAI's own field, streamed
                    stream = await clients[key].chat.completions.create(model="sim-7b", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                                                        user=user, stream=True, extra_headers=headers)
                    async for _ in stream:
                        pass
                else:  # the operator's header
                    await clients[key].chat.completions.create(model="sim-7b", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                                               extra_headers={**headers, "x-end-user": user})

        await asyncio.gather(*(one(i) for i in range(USERS)))
        assert all(c._client is base._client for c in clients.values()) and all(c._client is claude_base._client for c in claudes.values())

    asyncio.run(traffic())
    proxy.assert_all_finished(timeout=30)
    deadline = time.monotonic() + 30
    while not proxy.app.telemetry.idle and time.monotonic() < deadline:
        time.sleep(0.05)
    store = proxy.app.telemetry.records_sink.store
    store.flush()
    expected = collections.Counter(sent_by(i)[0] for i in range(USERS))

    # Counters: exact per tenant, requests and verdicts alike; no end user in any label.
    text = httpx.get(f"{proxy.url}/metrics").text
    for family in ("llmproxy_requests_total", "llmproxy_slo_requests_total"):
        counted: collections.Counter[str] = collections.Counter()
        for tenant, value in re.findall(rf'^{family}{{[^}}]*tenant="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
            counted[tenant] += float(value)
        assert counted == expected, (family, counted)
    assert "-u1" not in text and "user" not in set(re.findall(r'(\w+)="', text))

    # Spans: the tenant and user.id on every SERVER span.
    servers = [s for s in proxy.exporter.get_finished_spans() if s.kind.name == "SERVER"]
    assert collections.Counter(s.attributes["llmproxy.tenant"] for s in servers) == expected
    assert all(s.attributes["user.id"].startswith(s.attributes["llmproxy.tenant"] + "-u") for s in servers)
    assert len({s.attributes["user.id"] for s in servers}) == USERS

    # Records: each with its tenant and user; the aggregates count them exactly; the list filters by both.
    db = sqlite3.connect(proxy.settings.records_db)
    rows = db.execute("SELECT tenant, user_id FROM llmproxy_records").fetchall()
    assert collections.Counter(tenant for tenant, _ in rows) == expected
    assert all(user.startswith(tenant + "-u") for tenant, user in rows) and len({user for _, user in rows}) == USERS
    groups = ledger.gather([open_backend(proxy.settings.records_db)])
    assert {tenant: agg.requests for tenant, agg in groups.items()} == expected
    found = httpx.get(f"{proxy.url}/llmproxy/requests", params={"tenant": "agents", "user": "agents-u2"}).json()
    assert [(r["tenant"], r["user"]) for r in found] == [("agents", "agents-u2")]
    assert len(httpx.get(f"{proxy.url}/llmproxy/requests", params={"tenant": "batch", "limit": 5000}).json()) == expected["batch"]

    # No key in any record, span, metric, log or page (the raw file too: its typed columns are plain text).
    exported = b"".join(store.backend.export(0))
    spans = repr([dict(s.attributes) for s in proxy.exporter.get_finished_spans()])
    pages = httpx.get(f"{proxy.url}/ui").text + httpx.get(f"{proxy.url}/llmproxy/requests", params={"limit": 1000}).text \
        + httpx.get(f"{proxy.url}/llmproxy/summary").text
    raw = b"".join(open(proxy.settings.records_db + suffix, "rb").read() for suffix in ("", "-wal") if os.path.exists(proxy.settings.records_db + suffix))
    for key in keys:
        for where, haystack in (("records", exported.decode()), ("spans", spans), ("metrics", text), ("logs", caplog.text), ("pages", pages)):
            assert key not in haystack, (key, where)
        assert key.encode() not in raw
    assert caplog.text.count('"tenant":"search"') == expected["search"]  # the request log has them (and nothing else)
