"""`llm-latency-proxy demo`: the seed's napkin maths, measured.

Starts the simulator (7B-class defaults: prefill 5,000 tok/s, decode 100 tok/s) and the proxy as
real processes on free loopback ports, sends the four cases (about 100, 1,000, 5,000 and 10,000
prompt tokens, 100 output tokens) through the official `openai` client via the proxy, and prints
the measured split per case next to the napkin estimate Prefill(L_in) + Decode(L_out). Then a
reasoning model's three shapes with the same prompt and the same visible output: no reasoning,
visible reasoning (streamed as `reasoning_content`: decode) and hidden reasoning (o-series style:
only counted in usage, so it sits inside TTFT, estimated as the phase `reasoning`). Last, every
request is judged against two service-level objectives (`--slo`): the cases above against TTFT,
TPOT and e2e thresholds (long prompts and hidden reasoning miss TTFT, blamed on their phase), and
a batching engine (the simulator's law: per token = 8 + 2 ms x streams decoding) driven at 1 to
12 concurrent streams, whose capacity at a 30 ms TPOT objective is 11 streams: the SLO table
shows attainment, goodput, misses by blamed phase and the capacity `explain` reads off the fit.
Then two applications, each with its own API key (`--tenants`: known only by the keys'
fingerprints), share the proxy: `search` sends long prompts, `batch` asks for long answers, and
`explain --by tenant` tells them apart (whose misses are blamed on prefill, whose outputs are long).
"""
from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

import httpx

from .processes import free_port, started

CASES = (100, 1_000, 5_000, 10_000)
REASONING_PROMPT = 1_000
REASONING: tuple[tuple[str, dict[str, str]], ...] = (("none", {}), ("visible", {"x-sim-visible-reasoning": "{n}"}), ("hidden", {"x-sim-hidden-reasoning": "{n}"}))
PREFILL_TPS, DECODE_TPS = 5000.0, 100.0
CHAT_OVERHEAD = 7  # one user message: 3 per message + 1 for the role + 3 to prime the reply
WORDS = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " on")


def prompt_of(tokens: int) -> str:
    """Text of exactly `tokens` - CHAT_OVERHEAD tokens: each word is one token."""
    return "".join(WORDS[i % len(WORDS)] for i in range(max(1, tokens - CHAT_OVERHEAD)))


def run_cases(proxy_url: str, repeats: int, output_tokens: int) -> None:
    import openai
    from rich.progress import Progress

    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="demo-key-not-secret", max_retries=0)
    with Progress() as progress:
        task = progress.add_task("requests through the proxy", total=len(CASES) * repeats)
        for case in CASES:
            for _ in range(repeats):
                stream = client.chat.completions.create(
                    model="sim-7b", messages=[{"role": "user", "content": prompt_of(case)}],
                    max_tokens=output_tokens, stream=True)
                for _chunk in stream:
                    pass
                progress.advance(task)


def run_reasoning(proxy_url: str, repeats: int, output_tokens: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="demo-key-not-secret", max_retries=0)
    for _, headers in REASONING:
        for _ in range(repeats):
            extra = {k: v.format(n=2 * output_tokens) for k, v in headers.items()}
            for _chunk in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": prompt_of(REASONING_PROMPT)}],
                                                         max_tokens=output_tokens, stream=True, extra_headers=extra):
                pass


def reasoning_rows(records: list[dict[str, Any]], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for index, (name, _) in enumerate(REASONING):
        group = records[index * repeats : (index + 1) * repeats]
        med = lambda f: statistics.median(f(r) for r in group)  # noqa: E731
        rows.append({"shape": name, "ttft": med(lambda r: r["ttft_s"]), "reasoning": med(lambda r: r["phases_s"].get("reasoning", 0.0)),
                     "prefill": med(lambda r: r["phases_s"]["prefill"]), "decode": med(lambda r: r["phases_s"]["decode"]),
                     "total": med(lambda r: r["duration_s"]), "decode_tps": med(lambda r: r["decode_tokens_per_second"] or 0.0),
                     "completion": group[0]["completion_tokens"], "hidden": group[0]["hidden_reasoning_tokens"]})
    return rows


def print_reasoning(rows: list[dict[str, Any]], output_tokens: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"A reasoning model: {REASONING_PROMPT} prompt tokens, {output_tokens} visible output tokens, {2 * output_tokens} reasoning tokens")
    for column in ("reasoning", "ttft", "reasoning (est.)", "prefill", "decode", "total", "decode tok/s", "completion tok", "hidden tok"):
        table.add_column(column, justify="right")
    ms = lambda s: f"{s * 1000:.2f} ms" if s < 1 else f"{s:.3f} s"  # noqa: E731
    for r in rows:
        table.add_row(r["shape"], ms(r["ttft"]), ms(r["reasoning"]), ms(r["prefill"]), ms(r["decode"]), ms(r["total"]),
                      f"{r['decode_tps']:.1f}", str(r["completion"]), str(r["hidden"]))
    console = Console(width=max(Console().width, 150))
    console.print(table)
    console.print("Visible reasoning streams (decode: the user sees it). Hidden reasoning is generated before the first visible "
                  "token: it inflates TTFT, and the proxy attributes it (hidden tokens / the request's decode rate) instead of "
                  "calling it prefill.")


# The demo's objectives: the 7B cases above, and a batching engine's model (the simulator's law,
# switched on for that part only) at rising concurrency, whose capacity at 30 ms per token is
# (30 - 8) / 2 = 11 streams; at 12, TPOT misses begin.
OBJECTIVES = """objectives:
  - name: interactive
    models: ["sim-7b"]
    ttft: 0.5
    tpot: 0.03
    e2e: 10
    target: 0.95
  - name: batched
    models: ["sim-batch"]
    ttft: 0.5
    tpot: 0.03
    target: 0.95
"""
BATCH_ALPHA_MS, BATCH_BETA_MS, BATCH_LEVELS, BATCH_TOKENS = 8.0, 2.0, (1, 2, 4, 8, 12), 30
# Two applications behind one proxy, each with its own key: (tenant, key, prompt tokens, output tokens).
TENANTS = (("search", "demo-key-search-app", 8_000, 20), ("batch", "demo-key-batch-app", 100, 600))


def tenants_file() -> str:
    """The demo's --tenants file: the two applications by their keys' fingerprints (never the keys)."""
    from .serve.tenants import fingerprint

    return "tenants:\n" + "".join(f"  - name: {name}\n    keys: [\"{fingerprint(key)}\"]\n" for name, key, _, _ in TENANTS)


def run_tenants(proxy_url: str, repeats: int) -> None:
    """Each application's requests at once (threads), through the openai client with its own key and end users."""
    import threading

    import openai

    def app(key: str, prompt: int, output: int, user: str) -> None:
        client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=key, max_retries=0)
        for _chunk in client.chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": prompt_of(prompt)}],
                                                     max_tokens=output, stream=True, user=user):
            pass

    threads = [threading.Thread(target=app, args=(key, prompt, output, f"{name}-user-{i}"))
               for name, key, prompt, output in TENANTS for i in range(repeats)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_batching(proxy_url: str, sim_url: str, repeats: int) -> None:
    """Closed loops of 1, 2, 4, 8 and 12 clients against the batching law, one level after another."""
    import threading

    import openai

    httpx.post(f"{sim_url}/sim/config", json={"batch_alpha_ms": BATCH_ALPHA_MS, "batch_beta_ms": BATCH_BETA_MS}).raise_for_status()
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="demo-key-not-secret", max_retries=0)

    def worker() -> None:
        for _ in range(max(3, repeats)):
            for _chunk in client.chat.completions.create(model="sim-batch", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=BATCH_TOKENS, stream=True, extra_headers={"x-sim-ttft-ms": "5"}):
                pass

    try:
        for level in BATCH_LEVELS:
            threads = [threading.Thread(target=worker) for _ in range(level)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        httpx.post(f"{sim_url}/sim/config", json={"batch_alpha_ms": 0, "batch_beta_ms": 0}).raise_for_status()


def print_slo(store: Any, objectives: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from .answers import budget
    from .answers.explain import explain, gather

    groups = gather([store])
    report = explain(groups, objectives=objectives)
    table = Table(title="Service-level objectives, judged on every request above (--slo)")
    for column in ("slo", "objectives", "judged", "attainment", "target", "budget left", "goodput", "misses by blamed phase", "capacity"):
        table.add_column(column, justify="right", no_wrap=True)
    summaries = budget.summary(groups.values(), objectives)
    for o in objectives:
        s = summaries[o.name]
        stated = " ".join(f"{name} {value * 1000:g}ms" if value < 1 else f"{name} {value:g}s" for name, value in o.thresholds.items())
        misses = "; ".join(f"{missed}: " + ", ".join(f"{phase} {n}" for phase, n in blamed.items()) for missed, blamed in s["misses"].items())
        group = next((g for g in report.values() if g.get("slo", {}).get("name") == o.name and "capacity" in g), None)
        c = group["capacity"] if group else None
        capacity = (f"{c['streams']:.1f} streams (peak {c['peak_streams']})" if c and c["streams"] is not None else
                    ("too few concurrency levels" if c else "no tpot objective"))
        table.add_row(o.name, stated, str(s["judged"]), f"{s['attainment']:.1%}" if s["judged"] else "n/a", f"{o.target:.0%}",
                      f"{s['budget_left']:.0%}" if "budget_left" in s else "n/a", f"{s['goodput_rps']:.2f}/s" if s["judged"] else "n/a",
                      misses or "none", capacity)
    console = Console(width=max(Console().width, 190))
    console.print(table)
    console.print(f"Long prompts and hidden reasoning miss TTFT, each blamed on its own phase; the batching engine's time per token "
                  f"grows {BATCH_BETA_MS:g} ms per stream from {BATCH_ALPHA_MS:g} ms, so at 12 streams it misses TPOT (decode), and its "
                  f"capacity at 30 ms per token is read off the decode fit: the law says {(30 - BATCH_ALPHA_MS) / BATCH_BETA_MS:g}.")


API_PROMPT = 1000  # prompt tokens of the comparison of APIs
APIS = (("openai", "chat"), ("openai", "responses"), ("anthropic", "messages"), ("gemini", "generate_content"), ("ollama", "ollama_chat"))


def run_apis(proxy_url: str, repeats: int, output_tokens: int) -> None:
    """The same request through chat completions, the Responses API, Anthropic Messages, Gemini and
    Ollama, each with its own official client, interleaved."""
    import anthropic
    import ollama
    import openai
    from google import genai
    from google.genai import types

    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="demo-key-not-secret", max_retries=0)
    claude = anthropic.Anthropic(base_url=proxy_url, api_key="demo-key-not-secret", max_retries=0)
    gemini = genai.Client(api_key="demo-key-not-secret", http_options=types.HttpOptions(base_url=proxy_url))
    local = ollama.Client(host=proxy_url)
    messages = [{"role": "user", "content": prompt_of(API_PROMPT)}]
    for _ in range(repeats):
        for _chunk in client.chat.completions.create(model="sim-7b", messages=messages, max_tokens=output_tokens, stream=True):  # type: ignore[arg-type]
            pass
        for _event in client.responses.create(model="sim-7b", input=messages[0]["content"], max_output_tokens=output_tokens, stream=True):
            pass
        with claude.messages.stream(model="sim-7b", messages=messages, max_tokens=output_tokens) as stream:  # type: ignore[arg-type]
            stream.until_done()
        for _response in gemini.models.generate_content_stream(model="sim-7b", contents=messages[0]["content"],
                                                               config=types.GenerateContentConfig(max_output_tokens=output_tokens)):
            pass
        for _part in local.chat(model="sim-7b", messages=messages, stream=True, options={"num_predict": output_tokens}):
            pass


def print_apis(records: list[dict[str, Any]], output_tokens: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"One request, five APIs (chat, Responses, Anthropic Messages, Gemini, Ollama), each by its own SDK: "
                        f"{API_PROMPT} prompt tokens, {output_tokens} output tokens (medians)")
    for column in ("api endpoint", "ttft", "prefill", "decode", "total", "decode tok/s", "prompt tok", "completion tok"):
        table.add_column(column, justify="right")
    ms = lambda s: f"{s * 1000:.2f} ms" if s < 1 else f"{s:.3f} s"  # noqa: E731
    for api, endpoint in APIS:
        group = [r for r in records if r["api"] == api and r["endpoint"] == endpoint]
        med = lambda f: statistics.median(f(r) for r in group)  # noqa: E731
        table.add_row(f"{api} {endpoint}", ms(med(lambda r: r["ttft_s"])), ms(med(lambda r: r["phases_s"]["prefill"])),
                      ms(med(lambda r: r["phases_s"]["decode"])), ms(med(lambda r: r["duration_s"])),
                      f"{med(lambda r: r['decode_tokens_per_second'] or 0.0):.1f}", str(group[0]["prompt_tokens"]), str(group[0]["completion_tokens"]))
    Console(width=max(Console().width, 150)).print(table)


def summarise(records: list[dict[str, Any]], repeats: int, output_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for index, case in enumerate(CASES):
        group = records[index * repeats : (index + 1) * repeats]
        med = lambda f: statistics.median(f(r) for r in group)  # noqa: E731
        phases = {p: med(lambda r, p=p: r["phases_s"].get(p, 0.0)) for p in ("network", "tokenize", "prefill", "decode", "proxy")}
        total = med(lambda r: r["duration_s"])
        rows.append({
            "case": case,
            "prompt_tokens": group[0]["prompt_tokens"],
            **phases,
            "total": total,
            "napkin": case / PREFILL_TPS + output_tokens / DECODE_TPS,
            "decode_tps": med(lambda r: r["decode_tokens_per_second"] or 0.0),
            "dominant": max(phases, key=phases.__getitem__),
        })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Where the time goes (median per case, measured by the proxy)")
    for column in ("prompt tok", "network", "tokenize", "prefill", "decode", "proxy", "total", "napkin", "decode tok/s", "prefill %", "decode %", "dominates"):
        table.add_column(column, justify="right")
    ms = lambda s: f"{s * 1000:.2f} ms" if s < 1 else f"{s:.3f} s"  # noqa: E731
    for r in rows:
        table.add_row(
            str(r["prompt_tokens"]), ms(r["network"]), ms(r["tokenize"]), ms(r["prefill"]), ms(r["decode"]),
            ms(r["proxy"]), ms(r["total"]), ms(r["napkin"]), f"{r['decode_tps']:.1f}",
            f"{100 * r['prefill'] / r['total']:.0f}%", f"{100 * r['decode'] / r['total']:.0f}%", r["dominant"])
    console = Console(width=max(Console().width, 150))
    console.print(table)
    console.print("napkin = prompt / 5,000 tok/s + output / 100 tok/s (the seed's model). Short prompts: decode "
                  "dominates; at ~5,000 prompt tokens prefill matches decode; beyond, prefill dominates.")


def run_demo(repeats: int = 3, output_tokens: int = 100) -> int:
    sim_port, proxy_port = free_port(), free_port()
    sim_url, proxy_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{proxy_port}"
    print(f"simulator on {sim_url} (prefill {PREFILL_TPS:.0f} tok/s, decode {DECODE_TPS:.0f} tok/s); proxy on {proxy_url}")
    workdir = tempfile.mkdtemp(prefix="llmproxy-demo-")
    records_db, slo_path = os.path.join(workdir, "records.sqlite"), os.path.join(workdir, "slo.yaml")
    tenants_path = os.path.join(workdir, "tenants.yaml")
    with open(slo_path, "w", encoding="utf-8") as handle:
        handle.write(OBJECTIVES)
    with open(tenants_path, "w", encoding="utf-8") as handle:
        handle.write(tenants_file())
    with started(["simulate", "--port", str(sim_port)], f"{sim_url}/health"), \
         started(["serve", "--upstream", f"{sim_url}/v1", "--port", str(proxy_port), "--records-db", records_db, "--slo", slo_path,
                  "--tenants", tenants_path], f"{proxy_url}/healthz"):
        print(f"live waterfall of every request while the demo runs: {proxy_url}/ui")
        run_cases(proxy_url, repeats, output_tokens)
        run_reasoning(proxy_url, repeats, output_tokens)
        run_apis(proxy_url, repeats, output_tokens)
        total = (len(CASES) + len(REASONING) + len(APIS)) * repeats
        records = httpx.get(f"{proxy_url}/llmproxy/requests", params={"limit": total}).json()
        run_batching(proxy_url, sim_url, repeats)
        run_tenants(proxy_url, repeats)
    from .simulator import sessions

    show_agents, agents = sessions.demo(workdir)
    cases, reasoning = len(CASES) * repeats, len(REASONING) * repeats
    print_table(summarise(records[:cases], repeats, output_tokens))
    print_reasoning(reasoning_rows(records[cases : cases + reasoning], repeats), output_tokens)
    print_apis(records[cases + reasoning :], output_tokens)
    show_agents()
    from .answers.explain import explain, gather, render
    from .measure.slo import load as load_objectives
    from .records import open_backend

    objectives = load_objectives(slo_path)
    store = open_backend(records_db)
    print_slo(store, objectives)
    print(f"\nllm-latency-proxy explain --db {records_db} --slo {slo_path}   (the demo's traffic, from its records database)\n")
    print(render(explain(gather([store]), objectives=objectives)))
    print(f"llm-latency-proxy explain --db {agents[-1]}   (the agent sessions with pick: predicted_ttft: what the prefix cache saved)\n")
    print(render(explain(gather([open_backend(agents[-1])]))))
    from .answers import ledger

    print(f"llm-latency-proxy explain --db {records_db} --slo {slo_path} --by tenant   (whose requests are slow: `search` and `batch` "
          "each with its own key, the rest `unknown`)\n")
    print(ledger.render(ledger.report(ledger.gather([store]), objectives)))
    print(f"With a proxy running, {proxy_url.rsplit(':', 1)[0]}:PORT/ui shows every request as it finishes (the demo's was {proxy_url}/ui).")
    return 0
