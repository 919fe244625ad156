"""Agent-sized requests: a coding agent's conversation through this proxy and through Envoy, side by side.

    ENVOY=.venv-envoy/bin/envoy .venv/bin/python -m bench.relay agent [--turns 40] [--sessions 1] [--apis chat responses messages gemini] [--before DIR] [-- proxy flags]
    .venv/bin/python -m bench.relay agent --ab DIR_A DIR_B [--api chat] [--rounds 10]   # A/B, alternating rounds (`ab`)

The conversation is what Claude Code, Codex CLI or Gemini CLI send: a 170 KB system prompt and 30
tool schemas (about 42,000 prompt tokens of the proxy's tokenizer together), resent on every turn
with one more user message and the previous answer; each answer is 20 streamed chunks (TTFT 20 ms,
1,000 tok/s: the upstream's time is not what is measured). For each API that carries such prompts
(chat completions with `tools`, the Responses API with `instructions` and `tools`, Anthropic
Messages with `system` and `tools`, Gemini with `systemInstruction` and `tools`), the turns go
through each relay one after the other, interleaved per turn. Reported per relay: CPU per request
(every thread of the relay's processes, the proxy's offload worker included), the added TTFT p50
against the same request sent direct, and, for this proxy, the `tokenize` figure its records give
turn 1 and turn 40 of the same conversation. With `--sessions N`, N such conversations, each with its own system
prompt, interleaved turn by turn (5 x 40: what a proxy in front of several agents sees). Each relay is warmed first with one request of another
system prompt (the proxy's worker loads its BPE table once, at its first big prompt).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

WORDS = ("the", "repository", "function", "returns", "error", "test", "file", "change", "user", "build", "module", "command", "path",
         "value", "when", "should", "never", "always", "before", "after", "review", "commit", "branch", "output", "input", "agent")
HEADERS = {"x-sim-ttft-ms": "20", "x-sim-decode-tps": "1000"}


def system_prompt(size: int = 170_000, seed: int = 1) -> str:
    rng = random.Random(seed)
    lines, total = [], 0
    while total < size:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))).capitalize() + "."
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)


def tool_schemas(count: int = 30, seed: int = 2) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    tools = []
    for i in range(count):
        props = {f"arg_{j}": {"type": rng.choice(["string", "integer", "boolean"]),
                              "description": " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))} for j in range(rng.randint(3, 8))}
        tools.append({"name": f"tool_{i}", "description": " ".join(rng.choice(WORDS) for _ in range(40)),
                      "parameters": {"type": "object", "properties": props, "required": list(props)[:2]}})
    return tools


def session_prompt(session: int) -> str:
    """Session `session`'s system prompt: the agent's one, with its environment block in the middle (Claude Code and
    Codex write the working directory, the platform and the date there, 70% in): the same length and the same head and tail
    for every session, a few characters apart."""
    base = system_prompt()
    middle = len(base) * 7 // 10
    block = f"\n<env>Working directory: /home/dev/project-{session:03d}\nIs a git repo: yes\nToday's date: 2026-12-{1 + session % 28:02d}</env>\n"
    return base[:middle] + block + base[middle + len(block):]


def turn_bodies(api: str, turns: int, seed: int = 1, session: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) of each turn: the same system prompt and tools, the conversation one exchange longer."""
    system, tools = (system_prompt(seed=seed) if session is None else session_prompt(session)), tool_schemas()
    history: list[tuple[str, str]] = []
    out = []
    for turn in range(turns):
        history.append(("user", f"Turn {turn}: please look at the failing test in module {turn} and fix it."))
        if api == "chat":
            messages = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in history]
            out.append(("/v1/chat/completions", {"model": "agent-model", "messages": messages, "stream": True, "max_tokens": 20,
                                                 "tools": [{"type": "function", "function": t} for t in tools]}))
        elif api == "responses":
            out.append(("/v1/responses", {"model": "agent-model", "instructions": system, "stream": True, "max_output_tokens": 20,
                                          "input": [{"role": r, "content": c} for r, c in history],
                                          "tools": [{"type": "function", **t} for t in tools]}))
        elif api == "messages":
            out.append(("/v1/messages", {"model": "agent-model", "system": system, "stream": True, "max_tokens": 20,
                                         "messages": [{"role": r, "content": c} for r, c in history],
                                         "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in tools]}))
        else:
            out.append(("/v1beta/models/agent-model:streamGenerateContent?alt=sse",
                        {"systemInstruction": {"parts": [{"text": system}]}, "generationConfig": {"maxOutputTokens": 20},
                         "contents": [{"role": "model" if r == "assistant" else "user", "parts": [{"text": c}]} for r, c in history],
                         "tools": [{"functionDeclarations": [{"name": t["name"], "description": t["description"], "parameters": t["parameters"]}
                                                             for t in tools]}]}))
        history.append(("assistant", " ".join(WORDS[(turn + k) % len(WORDS)] for k in range(20))))
    return out


def conversations(api: str, turns: int, sessions: int) -> list[tuple[str, dict[str, Any]]]:
    """`sessions` conversations, each with its own system prompt (one agent's sessions, whose prompts embed their working
    directory and date: `session_prompt`), interleaved turn by turn: turn 1 of each, then turn 2 of each..."""
    if sessions == 1:
        return turn_bodies(api, turns)
    each = [turn_bodies(api, turns, session=k) for k in range(sessions)]
    return [each[k][turn] for turn in range(turns) for k in range(sessions)]


def one(client: httpx.Client, base: str, path: str, body: bytes) -> float:
    """TTFT of one streamed request (the first byte of the body after the head)."""
    began = time.perf_counter()
    with client.stream("POST", base + path, content=body, headers={**HEADERS, "content-type": "application/json"}) as response:
        first = None
        for _ in response.iter_raw():
            if first is None:
                first = time.perf_counter() - began
        assert response.status_code == 200, response.status_code
    return first or 0.0


def ab(sources: list[str], api: str, rounds: int) -> int:
    """Two (or more) checkouts over the same conversation, turn by turn: A/B at a resolution the side-by-side run
    lacks. On this VM two runs of the same tree differ by 5-10%, more than a change of a few percent; here the
    checkouts (each a `git worktree` built with mypyc: `pip install --no-deps --target DIR .`) serve the
    conversation's 40 turns in rounds: each turn goes direct, then through every checkout, in an order that alternates
    per round; per round, each checkout's CPU (every process: serving, records, worker) per turn. Reported: the median
    per checkout, the ratio of the first two medians, and that ratio round by round (its spread is the resolution)."""
    bodies = [(path, json.dumps(body).encode()) for path, body in turn_bodies(api, 40)]
    sim, db = free_port(), Path(tempfile.mkdtemp())
    every: dict[str, list[float]] = {src: [] for src in sources}
    serving: dict[str, list[float]] = {src: [] for src in sources}
    with common.simulator(sim), contextlib.ExitStack() as stack, httpx.Client(timeout=60) as client:
        relays = {}
        for k, src in enumerate(sources):
            port = free_port()
            command = serve_command(src, "serve", "--upstream", f"http://127.0.0.1:{sim}/v1", "--port", str(port), "--records-db",
                                    str(db / f"{k}.sqlite"))
            relays[src] = (f"http://127.0.0.1:{port}", stack.enter_context(common.process(command, f"http://127.0.0.1:{port}/healthz")).pid)
        for base, _ in relays.values():  # (the worker's BPE table, the first counts)
            for path, raw in bodies[:3]:
                one(client, base, path, raw)
        time.sleep(2.0)
        for r in range(rounds):
            order = sources if r % 2 == 0 else sources[::-1]
            started = {src: (common.cpu_seconds(pid), common.process_cpu_seconds(pid)) for src, (_, pid) in relays.items()}
            for path, raw in bodies:
                one(client, f"http://127.0.0.1:{sim}", path, raw)
                for src in order:
                    one(client, relays[src][0], path, raw)
            time.sleep(1.5)  # (the last turn's finish, its records)
            for src, (_, pid) in relays.items():
                every[src].append((common.cpu_seconds(pid) - started[src][0]) * 1000 / len(bodies))
                serving[src].append((common.process_cpu_seconds(pid) - started[src][1]) * 1000 / len(bodies))
            print(f"round {r + 1}: " + "  ".join(f"{src}: {every[src][-1]:.2f} ms ({serving[src][-1]:.2f})" for src in sources), flush=True)
    print(f"\ncommand: .venv/bin/python -m bench.relay agent {' '.join(sys.argv[1:])}; ms of CPU per turn, every process (the serving process's)")
    for src in sources:
        print(f"{src}: {statistics.median(every[src]):.3f} ({statistics.median(serving[src]):.3f})")
    if len(sources) >= 2:
        a, b = every[sources[0]], every[sources[1]]
        print(f"ratio of the medians, first / second: {statistics.median(a) / statistics.median(b):.3f}; by round: "
              + ", ".join(f"{x / y:.3f}" for x, y in zip(a, b)))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--sessions", type=int, default=1, help="conversations, each its own system prompt, interleaved turn by turn")
    parser.add_argument("--apis", nargs="+", default=["chat", "responses", "messages", "gemini"])
    parser.add_argument("--before", default="")
    parser.add_argument("--ab", nargs="+", default=[], metavar="DIR", help="A/B: these checkouts only, turn by turn in alternating rounds (`ab`)")
    parser.add_argument("--api", default="chat", choices=["chat", "responses", "messages", "gemini"], help="(--ab) the conversation's API")
    parser.add_argument("--rounds", type=int, default=10, help="(--ab) rounds")
    parser.add_argument("proxy_args", nargs="*")
    args = parser.parse_args()
    if args.ab:
        return ab(args.ab, args.api, args.rounds)
    sim_port = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim_port}"
    ports = {"envoy": free_port(), "this proxy": free_port()}
    db = Path(tempfile.mkdtemp())
    commands = {"this proxy": serve_command(str(ROOT), "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(ports["this proxy"]),
                                            "--records-db", str(db / "a.sqlite"), *args.proxy_args)}
    if args.before:
        ports["before"] = free_port()
        commands["before"] = serve_command(args.before, "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(ports["before"]),
                                           "--records-db", str(db / "b.sqlite"), *args.proxy_args)
    commands["envoy"] = common.envoy_command(ports["envoy"], sim_port)
    rows = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(common.simulator(sim_port))
        pids = {name: stack.enter_context(common.process(commands[name], f"http://127.0.0.1:{port}/{'health' if name == 'envoy' else 'healthz'}")).pid
                for name, port in ports.items()}
        client = stack.enter_context(httpx.Client(timeout=120))
        # Warm: a proxy's offload worker loads its BPE table at the first prompt it counts (about a
        # second of CPU, once per process); a conversation of another system prompt warms every relay.
        warm_path, warm = turn_bodies("chat", 1)[0]
        warm["messages"][0]["content"] = "warm-up " + warm["messages"][0]["content"]
        for port in ports.values():
            one(client, f"http://127.0.0.1:{port}", warm_path, json.dumps(warm).encode())
        time.sleep(3.0)
        for api in args.apis:
            bodies = [(path, json.dumps(body).encode()) for path, body in conversations(api, args.turns, args.sessions)]
            ttft: dict[str, list[float]] = {name: [] for name in [*ports, "direct"]}
            # Each relay's process does only its own requests' work: its CPU over the whole
            # conversation, the finish of the last turn included (tokenize, records), per turn.
            started_cpu = {name: common.cpu_seconds(pid) for name, pid in pids.items()}
            started_own = {name: common.process_cpu_seconds(pid) for name, pid in pids.items()}
            for path, raw in bodies:  # one turn through each relay (and direct), then the next turn
                ttft["direct"].append(one(client, compare.SIM_URL, path, raw))
                for name, port in ports.items():
                    ttft[name].append(one(client, f"http://127.0.0.1:{port}", path, raw))
            time.sleep(1.5)
            cpu = {name: common.cpu_seconds(pid) - started_cpu[name] for name, pid in pids.items()}
            own = {name: common.process_cpu_seconds(pid) - started_own[name] for name, pid in pids.items()}
            records = {name: httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": len(bodies)}).json()
                       for name, port in ports.items() if name != "envoy"}
            direct = statistics.median(ttft["direct"])
            for name in ports:
                row = {"api": api, "relay": name, "cpu_ms": cpu[name] / len(bodies) * 1000, "serving_ms": own[name] / len(bodies) * 1000,
                       "added_ttft_ms": (statistics.median(ttft[name]) - direct) * 1000}
                if name in records:
                    r = records[name]
                    row.update(tokenize_first_ms=(r[0]["tokenize_prompt_s"] or 0) * 1000, tokenize_last_ms=(r[-1]["tokenize_prompt_s"] or 0) * 1000,
                               prompt_tokens=(r[0]["prompt_tokens"], r[-1]["prompt_tokens"]), body_kb=len(bodies[-1][1]) / 1000)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\ncommand: ENVOY=.venv-envoy/bin/envoy .venv/bin/python -m bench.relay agent {' '.join(sys.argv[1:])}; {args.sessions} x {args.turns} turns per API, "
          "CPU per request is the mean over the turns")
    print("| api | relay | CPU per request (ms) | ÷ Envoy's | of it the serving process (ms) | added TTFT p50 (ms) | tokenize, turn 1 / last (ms) | prompt tokens, turn 1 / last |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        floor = next(r["cpu_ms"] for r in rows if r["api"] == row["api"] and r["relay"] == "envoy")
        tokenize = f"{row['tokenize_first_ms']:.2f} / {row['tokenize_last_ms']:.2f}" if "tokenize_first_ms" in row else ""
        tokens = f"{row['prompt_tokens'][0]} / {row['prompt_tokens'][1]}" if "prompt_tokens" in row else ""
        print(f"| {row['api']} | {row['relay']} | {row['cpu_ms']:.2f} | {row['cpu_ms'] / floor:.2f}× | {row['serving_ms']:.2f} | {row['added_ttft_ms']:.2f} | {tokenize} "
              f"| {tokens} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
