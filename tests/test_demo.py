"""`make demo`'s command runs end to end and prints the split table."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_prints_the_measured_split():
    out = subprocess.run([sys.executable, "-m", "proxy", "demo", "--repeats", "1", "--output-tokens", "20"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("│")]
    assert len(lines) == 16
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines]
    rows, reasoning, apis, agents, slos = lines[:4], cells[4:7], cells[7:12], cells[12:14], cells[14:]
    assert rows[0].split("│")[1].strip() == "100" and rows[-1].split("│")[1].strip() == "10000"
    # 20 output tokens at 100 tok/s = 0.19 s of decode: prefill dominates from 1,000 prompt tokens on.
    assert rows[0].rstrip(" │").endswith("decode") and rows[-1].rstrip(" │").endswith("prefill")
    # The reasoning table: same visible output; hidden reasoning is attributed, not called prefill.
    assert [r[0] for r in reasoning] == ["none", "visible", "hidden"]
    none, visible, hidden = reasoning
    assert none[2] == visible[2] == "0.00 ms" and hidden[2] != "0.00 ms"
    assert hidden[8] == "40" and visible[8] == "0"
    # Chat, the Responses API, Anthropic Messages, Gemini and Ollama: the same request, the same measured numbers.
    assert [r[0] for r in apis] == ["openai chat", "openai responses", "anthropic messages", "gemini generate_content", "ollama ollama_chat"]
    assert all(r[6:] == [apis[0][6], "20"] for r in apis)  # prompt and completion tokens agree
    assert all(r[1].endswith("ms") and r[5] != "0.0" for r in apis)
    # Agent sessions on two replicas with prefix caches: predicted_ttft keeps every turn where its conversation is cached.
    spread, placed = agents
    assert spread[0] == "fewest_in_flight" and placed[0] == "predicted_ttft" and int(placed[3].rstrip("%")) >= 75  # (a turn may move off a busy replica)
    assert int(placed[2].rstrip("%")) >= int(spread[2].rstrip("%")) - 2  # (fewest_in_flight may be lucky; never much better)
    assert "prefix cache: " in out.stdout and "served from cache" in out.stdout  # (explain: what the cache saved)
    # Every request judged: the long prompts (5,000 and 10,000 tokens) and the hidden reasoning miss TTFT, each blamed on
    # its phase; the batching engine misses TPOT at 12 streams (decode), and its capacity is the law's 11 streams within 10%.
    interactive, batched = slos
    # (and the two applications' requests: search's 8,000-token prompt misses TTFT on prefill, batch's long answer meets it)
    assert interactive[0] == "interactive" and interactive[2] == "14" and interactive[7] == "ttft: prefill 3, reasoning 1"
    assert batched[0] == "batched" and batched[7].startswith("tpot: decode ") and batched[8].endswith("streams (peak 12)")
    assert 9.9 <= float(batched[8].split()[0]) <= 12.1, batched
    # It ends with `explain` over its own traffic (read back from its records database) and the page's address.
    assert "llm-latency-proxy explain --db" in out.stdout and "== sim-7b @ 127.0.0.1:" in out.stdout
    assert "prefill: " in out.stdout and "dominates" in out.stdout and "/ui" in out.stdout
    # Then `explain --by tenant`: the application with long prompts, its misses blamed on prefill; the one with long answers.
    assert "--by tenant" in out.stdout and "== tenant search: 1 requests" in out.stdout and "== tenant batch: 1 requests" in out.stdout
    assert "search: 1 misses, 100% blamed on prefill" in out.stdout and "search: prompts are long" in out.stdout
    assert "batch: outputs are long" in out.stdout
