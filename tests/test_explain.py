"""`explain` recovers a known truth: synthetic records, then real traffic through the simulator."""
from __future__ import annotations

import random
import subprocess
import sys

import httpx
import pytest

from servers import ROOT, ProxyServer, Simulator
from proxy.answers.explain import explain, gather, of_records, roofline, theil_sen
from proxy.records import open_backend

PREFILL_TPS, FIXED_S, ITL_1, ITL_PER_REQUEST = 5000.0, 0.02, 0.010, 0.0004


def synthetic(n: int = 400, seed: int = 1) -> list[dict]:
    """Prefill 5,000 tok/s + 20 ms fixed, decode 100 tok/s at batch 1 slowing 0.4 ms per token per
    concurrent request, ±5% noise, 20% half-cached prompts, 5% stalled requests (3x)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randint(100, 8000)
        cached = prompt // 2 if rng.random() < 0.2 else 0
        concurrency = rng.randint(1, 16)
        stall = 3.0 if rng.random() < 0.05 else 1.0
        prefill = (FIXED_S + (prompt - cached) / PREFILL_TPS) * rng.uniform(0.95, 1.05) * stall
        itl = (ITL_1 + ITL_PER_REQUEST * (concurrency - 1)) * rng.uniform(0.95, 1.05) * stall
        output = rng.randint(50, 300)
        phases = {"network": 0.0006, "tokenize": 0.0002, "prefill": prefill, "decode": itl * (output - 1), "proxy": 0.0001}
        out.append({"model": "m", "upstream": "u", "outcome": "ok", "ttft_s": sum(phases.values()) - phases["decode"],
                    "prompt_tokens": prompt, "cached_prompt_tokens": cached, "completion_tokens": output, "hidden_reasoning_tokens": 0,
                    "decode_tokens_per_second": 1 / itl, "in_flight_at_decode": concurrency, "phases_s": phases,
                    "duration_s": sum(phases.values()), "received_unix_ns": 1_800_000_000_000_000_000 + i * 50_000_000})
    return out


def test_synthetic_truth_is_recovered():
    records = synthetic()
    g = explain(gather([of_records(records)]))["m @ u"]
    assert g["prefill"]["tokens_per_second"] == pytest.approx(PREFILL_TPS, rel=0.05)
    assert g["prefill"]["fixed_cost_s"] == pytest.approx(FIXED_S, rel=0.25, abs=0.005)
    assert g["decode"]["tokens_per_second_at_1"] == pytest.approx(100.0, rel=0.05)
    assert g["decode"]["slope"] == pytest.approx(ITL_PER_REQUEST, rel=0.10)
    median_output = g["median_output_tokens"]
    truth = (median_output * ITL_1 - FIXED_S) * PREFILL_TPS
    assert g["crossover_prompt_tokens"] == pytest.approx(truth, rel=0.10)
    assert g["dominant"] in ("decode", "prefill") and abs(sum(v["share"] for v in g["budget"].values()) - 1) < 1e-9
    assert g["what_if"]["2ms_less_per_output_token_saves_s"] == pytest.approx(0.002 * median_output)
    assert g["throughput"]["aggregate_over_per_request"] > 0 and len(g["diagnosis"]) == 3
    print(f"\nsynthetic truth: prefill {g['prefill']['tokens_per_second']:.0f} tok/s (5000), decode at 1 "
          f"{g['decode']['tokens_per_second_at_1']:.1f} tok/s (100), slope {g['decode']['slope'] * 1000:.3f} ms (0.400), "
          f"crossover {g['crossover_prompt_tokens']:.0f} tokens ({truth:.0f})")


def test_theil_sen_ignores_outliers_and_needs_spread():
    xs = [float(x) for x in range(20)]
    ys = [2.0 + 0.5 * x for x in xs]
    ys[3], ys[17] = 100.0, -50.0
    fit = theil_sen(list(zip(xs, ys)))
    assert fit is not None and fit.slope == pytest.approx(0.5) and fit.intercept == pytest.approx(2.0)
    assert theil_sen([(1.0, 2.0), (1.0, 3.0)]) is None


def test_roofline_arithmetic_of_the_background_reading():
    # 7B parameters in 16-bit weights read once per token: 14 GB; an H100's 3.35 TB/s.
    assert roofline(7e9, 2, 3.35e12) == pytest.approx(239.29, abs=0.01)
    # plus a 7B model's KV cache (32 layers x 4096 x K and V x 2 bytes = 0.5 MiB per token) at 1k context
    assert roofline(7e9, 2, 3.35e12, 524_288, 1000) == pytest.approx(3.35e12 / (14e9 + 524_288_000), rel=1e-9)
    g = explain(gather([of_records(synthetic())]), {"params": 7e9, "bytes_per_param": 2, "bandwidth": 3.35e12})["m @ u"]
    assert g["roofline"]["mbu"] == pytest.approx(g["decode"]["tokens_per_second_at_1"] / 239.29, rel=0.001)


def test_real_traffic_through_the_simulator_at_two_prefill_rates(tmp_path):
    sim = Simulator()
    path = tmp_path / "records.sqlite"
    proxy = ProxyServer(f"{sim.url}/v1", records_db=str(path))
    try:
        for model, rate in (("fast", 10000.0), ("slow", 2500.0)):
            sim.configure(prefill_tps=rate, decode_tps=200.0)
            for k, tokens in enumerate((200, 800, 1600, 2400, 3200, 200, 800, 1600, 2400, 3200)):
                body = {"model": model, "messages": [{"role": "user", "content": " the" * tokens}], "max_tokens": 10, "stream": True}
                api_path = "/messages" if model == "slow" and k % 2 else "/chat/completions"  # one engine, two APIs: one fit
                httpx.post(f"{proxy.v1}{api_path}", json=body, timeout=30).raise_for_status()
        for load_ms in ("300", "0", "0"):  # a laptop's Ollama: the first request waits for the model to load
            httpx.post(f"{proxy.url}/api/chat", json={"model": "laptop", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 5}},
                       headers={"x-sim-load-ms": load_ms, "x-sim-ttft-ms": "20"}, timeout=30).raise_for_status()
        proxy.wait_records(23)
        report = explain(gather([open_backend(str(path))]))
        png = tmp_path / "fits.png"
        out = subprocess.run([sys.executable, "-m", "proxy", "explain", "--db", str(path), "--plot", str(png)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    finally:
        proxy.stop()
        sim.proc.stop()
    upstream = proxy.settings.upstream_label
    assert report[f"fast @ {upstream}"]["prefill"]["tokens_per_second"] == pytest.approx(10000, rel=0.10)
    assert report[f"slow @ {upstream}"]["prefill"]["tokens_per_second"] == pytest.approx(2500, rel=0.10)
    assert report[f"slow @ {upstream}"]["apis"] == {"anthropic messages": 5, "openai chat": 5}
    assert "apis: anthropic messages 5, openai chat 5" in out.stdout
    cold = report[f"laptop @ {upstream}"]["load"]
    assert cold["requests"] == 1 and cold["median_s"] == pytest.approx(0.300, abs=0.015)
    assert "model load (engine-reported): 1 of 3 requests waited for it" in out.stdout
    assert out.returncode == 0 and "prefill: " in out.stdout and "dominates" in out.stdout, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    print("\n" + out.stdout)
