"""What one scrape of /metrics costs at the model cap: series, bytes, and time to render.

    .venv/bin/python -m bench.scale scrape                 # this checkout
    .venv/bin/python -m bench.scale scrape --src /tmp/old  # another checkout (git worktree), same harness
    .venv/bin/python -m bench.scale scrape --tenants 50 --named 20 --users 10000   # and callers told apart

A proxy (from `--src`) in front of the simulator receives one successful request per label set for
100 models (the default --max-models) through every API: chat, completions, Responses, Anthropic
Messages, Gemini and Ollama's chat (streaming and not), embeddings and Azure's chat path (1,500
requests, TTFT 0, 3 tokens each), then /metrics is fetched `--scrapes` times. Series = sample lines of the text exposition.
With `--tenants N`, request i comes from tenant `tenant-(i mod N)` (header x-tenant; the first `--named`
of them named in a --tenants file, the rest `other` in metrics) and a distinct end user; with
`--users U`, embeddings requests from new end users follow until U end users were seen.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import process, simulator  # noqa: E402

from proxy.processes import free_port, serve_command  # noqa: E402

FAST = {"x-sim-ttft-ms": "0", "x-sim-decode-tps": "10000"}


def tenants_file(named: int) -> str:
    """A --tenants file: `tenant-00` ... named (a nameless header entry listing them), any other value of the header a tenant too."""
    listed = ", ".join(f"tenant-{i:02d}" for i in range(named))
    return (f"tenants:\n  - header: {{name: x-tenant, values: [{listed}]}}\n  - header: {{name: x-tenant, values: any}}\n"
            "users:\n  header: x-end-user\n")


def fill_to_the_cap(base: str, models: int = 100, tenants: int = 0, users: int = 0, name: str = "model-{:03d}") -> int:
    """One ok request per (model, endpoint, stream) label set, through every API the proxy measures:
    chat, completions, the Responses API, Anthropic Messages, Gemini and Ollama's chat, streaming and
    not, embeddings and Azure OpenAI's chat path (with `tenants`: each from the next tenant and a new
    end user; then embeddings from new end users up to `users`); returns how many were sent."""
    sent = 0
    with httpx.Client(base_url=base, timeout=30, headers=FAST) as client:
        for i in range(models):
            model = name.format(i)
            messages = [{"role": "user", "content": "hi"}]
            requests: list[tuple[str, dict[str, object]]] = [("/v1/embeddings", {"model": model, "input": "hi"})]
            for stream in (True, False):
                requests += [("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 3, "stream": stream}),
                             ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 3, "stream": stream}),
                             ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 3, "stream": stream}),
                             ("/v1/messages", {"model": model, "messages": messages, "max_tokens": 3, "stream": stream}),
                             (f"/openai/deployments/{model}/chat/completions?api-version=2024-10-21",
                              {"messages": messages, "max_tokens": 3, "stream": stream}),
                             (f"/v1beta/models/{model}:{'streamGenerateContent?alt=sse' if stream else 'generateContent'}",
                              {"contents": "hi", "generationConfig": {"maxOutputTokens": 3}}),
                             ("/api/chat", {"model": model, "messages": messages, "options": {"num_predict": 3}, "stream": stream})]
            for path, body in requests:
                who = {"x-tenant": f"tenant-{sent % tenants:02d}", "x-end-user": f"user-{sent}"} if tenants else {}
                response = client.post(path, json=body, headers=who)
                response.raise_for_status()
                sent += 1
        for n in range(sent, users):
            client.post("/v1/embeddings", json={"model": name.format(n % models), "input": "hi"},
                        headers={"x-tenant": f"tenant-{n % max(1, tenants):02d}", "x-end-user": f"user-{n}"}).raise_for_status()
            sent += 1
    return sent


def series(exposition: bytes) -> int:
    return sum(1 for line in exposition.splitlines() if line and not line.startswith(b"#"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2]))
    parser.add_argument("--scrapes", type=int, default=7)
    parser.add_argument("--tenants", type=int, default=0, help="distinct tenants sending (0: none named, all `unknown`)")
    parser.add_argument("--named", type=int, default=20, help="of them, named in the --tenants file")
    parser.add_argument("--users", type=int, default=0, help="distinct end users at least")
    parser.add_argument("--model-name", default="model-{:03d}", help="the models' names (a format of their number): a real one's length")
    parser.add_argument("--families", type=int, default=0, help="also list the N families with the most bytes")
    parser.add_argument("proxy_args", nargs="*", help="extra flags for the proxy, after --")
    args = parser.parse_args()
    sim_port, port = free_port(), free_port()
    extra = list(args.proxy_args)
    if args.tenants:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="llmproxy-scrape-")) / "tenants.yaml"
        path.write_text(tenants_file(args.named))
        extra += ["--tenants", str(path)]
    with simulator(sim_port):
        command = serve_command(args.src, "serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1", "--port", str(port), *extra)
        with process(command, f"http://127.0.0.1:{port}/healthz"):
            base = f"http://127.0.0.1:{port}"
            sent = fill_to_the_cap(base, tenants=args.tenants, users=args.users, name=args.model_name)
            times, body = [], b""
            for _ in range(args.scrapes):
                began = time.perf_counter()
                body = httpx.get(f"{base}/metrics").content
                times.append(time.perf_counter() - began)
    print(f"src: {args.src}; requests: {sent}")
    print("| series | MB | scrape ms (median of %d) | llmproxy_*_created series |" % args.scrapes)
    print("|---|---|---|---|")
    created = sum(1 for line in body.splitlines() if b"_created" in line and not line.startswith(b"#"))
    print(f"| {series(body):,} | {len(body) / 1e6:.2f} | {statistics.median(times) * 1000:.1f} | {created:,} |")
    if args.families:
        families: dict[str, list[int]] = {}
        for line in body.splitlines():
            if line and not line.startswith(b"#"):
                name = line.split(b"{")[0].split(b" ")[0].decode()
                for suffix in ("_bucket", "_sum", "_count", "_total"):
                    name = name.removesuffix(suffix)
                cell = families.setdefault(name, [0, 0])
                cell[0] += 1
                cell[1] += len(line) + 1
        print("\n| family | series | KB |\n|---|---|---|")
        for name, (n, size) in sorted(families.items(), key=lambda item: -item[1][1])[:args.families]:
            print(f"| {name} | {n:,} | {size / 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
