"""`explain` on objectives: attainment, budget left and misses by phase from records, and the
capacity at the tpot objective checked against an engine that follows continuous batching's law
(the simulator: time per token = alpha + beta x streams decoding), whose true answer is known."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from proxy.answers import budget
from proxy.answers.explain import explain, gather, of_records
from proxy.records.aggregate import read
from proxy.records.sql import Window
from proxy.measure.slo import parse

from servers import ProxyServer, Simulator

OBJECTIVES = parse("""
objectives:
  - name: chat
    models: ["batch-*"]
    ttft: 0.5
    tpot: 0.03
    target: 0.9
""")


def record(good, blame=None, decode_tps=None, in_flight=None, at=0.0):
    return {"model": "batch-7b", "upstream": "u", "outcome": "ok", "ttft_s": 0.1, "duration_s": 1.0, "phases_s": {"prefill": 0.1},
            "received_unix_ns": int(at * 1e9), "slo": "chat", "slo_good": good, "slo_blame": blame or {},
            "decode_tokens_per_second": decode_tps, "in_flight_at_decode": in_flight, "completion_tokens": 10}


def test_attainment_budget_and_misses_from_records():
    records = [record(True, at=i) for i in range(16)] + [record(False, {"ttft": "queue"}, at=16), record(False, {"ttft": "queue"}, at=17),
                                                         record(False, {"ttft": "prefill", "tpot": "decode"}, at=18), record(None, at=19)]
    by_slo = read([of_records(records)], ("slo",), Window(), histograms=False)  # (through a store: what explain reads)
    s = budget.attainment(by_slo[("chat",)].slos["chat"], OBJECTIVES[0])
    assert (s["judged"], s["good"], s["bad"]) == (19, 16, 3)
    assert s["attainment"] == pytest.approx(16 / 19)
    assert s["budget_left"] == pytest.approx(1 - (3 / 19) / 0.1)  # overspent: below 0
    assert s["misses"] == {"tpot": {"decode": 1}, "ttft": {"queue": 2, "prefill": 1}}
    assert s["goodput_rps"] == pytest.approx(16 / 19) and s["throughput_rps"] == pytest.approx(19 / 19)  # judged ones: 0 to 19 s
    lines = budget.render("chat", s)
    assert "attainment 84.21% (target 90.00%)" in lines[0] and "ttft misses: 3 (queue 67%, prefill 33%)" in lines[2]


def test_capacity_needs_several_concurrency_levels_and_a_slope():
    one_level = {4: 10}  # decoding requests per concurrency level
    c = budget.capacity(one_level, {"intercept": 0.01, "slope": 0.002}, OBJECTIVES[0])
    assert c["streams"] is None and "3 or more concurrency levels" in c["note"] and c["peak_streams"] == 4
    assert budget.capacity(one_level, None, parse("objectives:\n  - name: e\n    models: [x]\n    e2e: 1\n    target: 0.9\n")[0]) is None
    levels = {1: 3, 2: 3, 4: 3}
    c = budget.capacity(levels, {"intercept": 0.01, "slope": 0.002}, OBJECTIVES[0])
    assert c["streams"] == pytest.approx(10.0) and c["peak_streams"] == 4 and c["headroom"] == pytest.approx(2.5) and "note" not in c
    flat = budget.capacity(levels, {"intercept": 0.01, "slope": 0.0}, OBJECTIVES[0])
    assert flat["streams"] is None and "does not grow" in flat["note"]


ALPHA_MS, BETA_MS, TPOT = 10.0, 2.0, 0.03  # the law's answer: (30 - 10) / 2 = 10 streams
LEVELS = (1, 2, 4, 6, 8)


@pytest.mark.e2e
@pytest.mark.slow
def test_capacity_matches_the_batching_law_within_ten_percent(tmp_path: Path):
    engine = Simulator("--batch-alpha-ms", str(ALPHA_MS), "--batch-beta-ms", str(BETA_MS))
    slo_path = tmp_path / "slo.yaml"
    slo_path.write_text("objectives:\n  - name: chat\n    models: ['batch-*']\n    ttft: 0.5\n    tpot: 0.03\n    target: 0.9\n")
    db = tmp_path / "records.sqlite"
    server = ProxyServer(f"{engine.url}/v1", slo=str(slo_path), records_db=str(db))
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0, timeout=60)

        def worker(requests: int) -> None:
            for _ in range(requests):
                for _chunk in client.chat.completions.create(model="batch-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                                             stream=True, extra_headers={"x-sim-ttft-ms": "5"}):
                    pass

        for level in LEVELS:  # closed loops of `level` clients, one level after another
            threads = [threading.Thread(target=worker, args=(5,)) for _ in range(level)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        server.wait_records(5 * sum(LEVELS), timeout=20)
        server.app.telemetry.records_sink.store.flush()
    finally:
        server.stop()
        engine.proc.stop()
    done = subprocess.run([sys.executable, "-m", "proxy", "explain", "--db", str(db), "--slo", str(slo_path), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    group = next(g for name, g in report.items() if name.startswith("batch-7b @"))
    capacity, law = group["capacity"], (TPOT * 1000 - ALPHA_MS) / BETA_MS
    print(f"\ncapacity at tpot {TPOT * 1000:g} ms: {capacity['streams']:.2f} streams (the law's {law:g}); decode fit "
          f"alpha {group['decode']['intercept'] * 1000:.2f} ms, beta {group['decode']['slope'] * 1000:.3f} ms per stream")
    assert set(capacity) >= {"tpot_s", "streams", "peak_streams"} and capacity["tpot_s"] == TPOT
    assert abs(capacity["streams"] - law) <= 0.1 * law, capacity
    assert capacity["peak_streams"] == max(LEVELS)
    assert group["slo"]["name"] == "chat" and group["slo"]["judged"] == 5 * sum(LEVELS)
    # The time per token at 8 streams is 10 + 2 x 8 = 26 ms: every request met 30 ms; at 10 streams it would not.
    assert group["slo"]["attainment"] == 1.0 and group["slo"]["budget_left"] == 1.0
    text = subprocess.run([sys.executable, "-m", "proxy", "explain", "--db", str(db), "--slo", str(slo_path)], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent).stdout
    assert "SLO chat: 105 of 105 good, attainment 100.00% (target 90.00%)" in text and "capacity at tpot 30 ms: " in text


def test_explain_reports_the_slo_and_capacity_keys_per_model_group():
    records = [record(True, decode_tps=1 / (0.01 + 0.002 * c), in_flight=c, at=i) for i, c in enumerate((1, 2, 4) * 3)]
    report = explain(gather([of_records(records)]), objectives=OBJECTIVES)
    group = report["batch-7b @ u"]
    assert group["slo"]["name"] == "chat" and group["slo"]["attainment"] == 1.0
    assert group["capacity"]["streams"] == pytest.approx(10.0, rel=1e-6) and group["capacity"]["peak_streams"] == 4
