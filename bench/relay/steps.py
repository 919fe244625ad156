"""Where an agent's turn goes inside the running proxy: each step's thread CPU, per turn.

    .venv/bin/python -m bench.relay steps [--src DIR] [--api chat] [--rounds 2]

The proxy is started with wrappers patched in before `main()`: each listed function (a protocol callback, a
dialect's parse, a telemetry step) is timed with `time.thread_time_ns` around its call and summed. Only
functions that do not suspend are listed (a coroutine's time would include whatever ran while it waited).
The turns are `bench/relay/agent.py`'s conversation, each sent direct first, as agent.py interleaves them: the CPU's
caches are as cold as they are there (the same steps in a tight loop cost a third to a half as much). The
wrappers add about 1 µs a call; nested steps are each counted whole (a step's figure includes those under it).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.relay import agent  # noqa: E402
from bench import harness as common  # noqa: E402

from proxy.processes import free_port  # noqa: E402

# (module, attribute path, label): what is timed. Nested entries are each counted whole.
STEPS = [
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.data_received", "uvicorn: a client read (all of it)"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_headers_complete", "uvicorn: scope, cycle, task"),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.send", "uvicorn: ASGI send (head, end)"),
    ("proxy.serve.server", "GuardedHttpTools.on_message_begin", "server: a request's stamps"),
    ("proxy.serve.relay", "Exchange.__init__", "relay: the exchange, its timing record"),
    ("proxy.apis", "parse_request", "apis: the body's JSON parsed"),
    ("proxy.fleet.placement", "Placement.body", "placement: the body sent (usage injected)"),
    ("proxy.upstream.connection", "Connection.write", "connection: the request written upstream"),
    ("proxy.upstream.connection", "Connection.data_received", "connection: an upstream read (all of it)"),
    ("proxy.upstream.pump", "Pump.forward", "pump: a piece stamped, read, written"),
    ("proxy.measure.telemetry", "Telemetry.start", "telemetry: start"),
    ("proxy.measure.telemetry", "Telemetry.finish", "telemetry: finish (queued, the finisher's task)"),
    ("proxy.measure.telemetry", "Telemetry._complete", "telemetry: the finish (all of it)"),
    ("proxy.measure.telemetry", "Telemetry._prompt_count", "telemetry: the prompt counted"),
    ("proxy.wire.tokens", "TokenCache.lookup", "tokens: the parts looked up"),
    ("proxy.measure.telemetry", "Telemetry._export", "telemetry: split, verdict, sinks"),
    ("proxy.measure.telemetry", "MetricsSink.export", "metrics: observed"),
    ("proxy.measure.telemetry", "RecordsSink.export", "records: made, serialised, sent"),
]

PATCH = r'''
import functools, importlib, json, signal, time
ACC, N = {}, {}
def _wrap(module, path, label):
    owner = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    f = getattr(owner, name)
    def add(began):
        ACC[label] = ACC.get(label, 0) + time.thread_time_ns() - began
        N[label] = N.get(label, 0) + 1
    if getattr(f, "__code__", None) is not None and f.__code__.co_flags & 0x80:  # a coroutine function (none suspends here)
        @functools.wraps(f)
        async def timed(*a, **k):
            began = time.thread_time_ns()
            try:
                return await f(*a, **k)
            finally:
                add(began)
    else:
        @functools.wraps(f)
        def timed(*a, **k):
            began = time.thread_time_ns()
            try:
                return f(*a, **k)
            finally:
                add(began)
    setattr(owner, name, timed)
for step in STEPS:
    _wrap(*step)
from proxy.apis import openai as _o, anthropic as _a, gemini as _g
for _cls in (_o.OpenAI, _a.Anthropic, _g.Gemini):  # (the dialects' prompt parts, read at the finish)
    _wrap(_cls.__module__, _cls.__name__ + ".prompt_parts", "apis: the prompt's parts read")
def _dump(*_):
    json.dump({k: (ACC[k], N[k]) for k in ACC}, open(OUT, "w")); ACC.clear(); N.clear()
signal.signal(signal.SIGUSR2, _dump)
'''


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2]), help="the checkout to run")
    parser.add_argument("--api", default="chat", choices=["chat", "responses", "messages", "gemini"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "steps.json"
    bodies = [(path, json.dumps(body).encode()) for path, body in agent.turn_bodies(args.api, 40)]
    sim, port = free_port(), free_port()
    code = (f"import sys; sys.path.insert(0, {args.src!r})\nSTEPS = {STEPS!r}\nOUT = {str(out)!r}\n{PATCH}\n"
            "from proxy.cli import main; sys.exit(main())")
    command = [sys.executable, "-c", code, "serve", "--upstream", f"http://127.0.0.1:{sim}/v1", "--port", str(port),
               "--records-db", str(out.parent / "records.sqlite")]
    with common.simulator(sim), common.process(command, f"http://127.0.0.1:{port}/healthz") as proc, httpx.Client(timeout=60) as client:
        base = f"http://127.0.0.1:{port}"
        for path, raw in bodies[:3]:
            agent.one(client, base, path, raw)
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGUSR2)  # (the warm-up's figures dropped)
        time.sleep(0.2)
        began, turns = common.cpu_seconds(proc.pid), 0
        for _ in range(args.rounds):
            for path, raw in bodies:
                agent.one(client, f"http://127.0.0.1:{sim}", path, raw)
                agent.one(client, base, path, raw)
                turns += 1
        time.sleep(1.0)
        cpu = common.cpu_seconds(proc.pid) - began
        os.kill(proc.pid, signal.SIGUSR2)
        time.sleep(0.5)
    steps = json.loads(out.read_text())
    print(f"command: .venv/bin/python -m bench.relay steps {' '.join(sys.argv[1:])}")
    print(f"{turns} turns ({args.api}); the serving process: {cpu / turns * 1e3:.2f} ms of CPU a turn, wrappers included\n")
    print("| step | µs a turn | calls a turn |\n|---|---|---|")
    for label, (ns, calls) in sorted(steps.items(), key=lambda kv: -kv[1][0]):
        print(f"| {label} | {ns / turns / 1e3:.1f} | {calls / turns:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
