"""`explain --by tenant` (proxy/answers/ledger.py): whose requests are slow, told apart from real traffic
through the proxy by the applications' own keys."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from proxy.serve.tenants import fingerprint

KEYS = {"search": "sk-search-app-000000001", "batch": "sk-batch-app-000000002"}


@pytest.mark.e2e
def test_explain_by_tenant_names_the_long_prompts_and_blames_their_misses_on_prefill(proxy_factory, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n" + "".join(f"  - name: {name}\n    keys: ['{fingerprint(key)}']\n" for name, key in KEYS.items()))
    objectives = tmp_path / "slo.yaml"
    objectives.write_text("objectives:\n  - name: chat\n    models: [sim-7b]\n    ttft: 0.5\n    e2e: 10\n    target: 0.95\n")
    proxy = proxy_factory(tenants=str(tenants), slo=str(objectives))

    def send(tenant: str, prompt_tokens: int, output_tokens: int, decode_tps: int) -> None:
        client = openai.OpenAI(base_url=proxy.v1, api_key=KEYS[tenant], max_retries=0)
        stream = client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": " the" * prompt_tokens}],
                                                max_tokens=output_tokens, stream=True, user=f"{tenant}-user",
                                                extra_headers={"x-sim-decode-tps": str(decode_tps)})
        for _ in stream:
            pass

    with ThreadPoolExecutor(8) as pool:  # batch: short prompts, long answers (all good); then search: 4,000-token prompts (800 ms of prefill)
        list(pool.map(lambda _: send("batch", 50, 300, 3000), range(8)))
        list(pool.map(lambda _: send("search", 4000, 5, 3000), range(6)))
    proxy.wait_records(14)
    deadline = time.monotonic() + 10
    while not proxy.app.telemetry.idle and time.monotonic() < deadline:
        time.sleep(0.02)
    proxy.app.telemetry.records_sink.store.flush()

    command = [sys.executable, "-m", "proxy", "explain", "--db", proxy.settings.records_db, "--slo", str(objectives), "--by", "tenant"]
    report = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True, check=True).stdout)
    assert set(report) == {"search", "batch"}  # one group per tenant
    search, batch = report["search"], report["batch"]
    assert (search["requests"], batch["requests"]) == (6, 8)
    assert search["slo"]["chat"]["bad"] == 6 and search["blamed"] == {"prefill": 6}  # every miss: TTFT, blamed on prefill
    assert batch["slo"]["chat"]["bad"] == 0 and batch["blamed"] == {}
    assert search["slo"]["chat"]["budget_spent"] == pytest.approx(6 / (14 * 0.05))  # of the objective's whole budget over the window
    assert search["mean"]["prompt_tokens"] > 20 * batch["mean"]["prompt_tokens"]
    assert batch["mean"]["output_tokens"] > 20 * search["mean"]["output_tokens"]
    phases = search["mean"]["phases_s"]
    assert phases["prefill"] == max(phases.values()) and phases["prefill"] == pytest.approx(0.8, abs=0.15)  # 4,000 tokens at 5,000 tok/s
    assert sum(phases.values()) == pytest.approx(search["mean"]["e2e_s"], rel=1e-6)  # the means add up
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "search: 6 misses, 100% blamed on prefill" in text and "search: prompts are long" in text
    assert "batch: outputs are long" in text and "batch: " + "prompts are long" not in text
