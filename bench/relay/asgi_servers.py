"""The proxy's ASGI app under uvicorn (how it ships) and under Granian (a Rust HTTP server), side by
side in one run: sequential added TTFT, CPU per chunk at 1/16/64 streams (the whole process tree:
Granian serves from a worker process), a keep-alive burst's TTFT p50.

    .venv/bin/python -m bench.relay asgi-servers          # REPS=2 by default (alternating)

Under Granian the app runs without this project's server protocol (server.py), so a request's
first byte is stamped when its task starts; the figures compared here do not use the stamps.
"""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import harness as common  # noqa: E402
from bench.relay import compare  # noqa: E402

from proxy.serve.app import SETTINGS_ENV  # noqa: E402
from proxy.config import Settings  # noqa: E402
from proxy.processes import free_port, serve_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GRANIAN = str(Path(sys.executable).parent / "granian")  # pip install granian (make bench)


def main() -> None:
    sim = free_port()
    compare.SIM_URL = f"http://127.0.0.1:{sim}"
    reps = int(os.environ.get('REPS', '2'))
    with common.simulator(sim):
        for rep in range(reps):
            for server in ('uvicorn', 'granian'):
                port = free_port()
                if server == 'uvicorn':
                    cmd, env = serve_command(str(ROOT), "serve", "--upstream", f"{compare.SIM_URL}/v1", "--port", str(port)), {}
                else:
                    settings = Settings(upstream=f"{compare.SIM_URL}/v1", port=port)
                    env = {SETTINGS_ENV: settings.to_json()}
                    cmd = [GRANIAN, '--interface', 'asgi', '--factory', 'proxy.serve.app:app_from_env', '--host', '127.0.0.1',
                           '--port', str(port), '--loop', 'uvloop', '--workers', '1', '--runtime-mode', 'st', '--no-ws', '--log-level', 'warning']
                with common.process(cmd, f"http://127.0.0.1:{port}/healthz", env) as proc:
                    compare.schedule(compare.SEQ_SCHEDULE)
                    seq = asyncio.run(compare.sequential((sim, "/v1"), (port, "/v1"), 40))
                    compare.schedule(compare.SWEEP_SCHEDULE)
                    out = [f"{server:8s} seq added p50 {common.pct(seq['added_ttft'], .5)*1e3:.3f} ms"]
                    for streams in (1, 16, 64):
                        b = common.cpu_seconds(proc.pid)
                        r = asyncio.run(compare.concurrent((port, "/v1"), streams, 4))
                        out.append(f"c{streams} {(common.cpu_seconds(proc.pid) - b) / r['chunks'] * 1e6:.1f} us/chunk")
                    bursts = asyncio.run(compare.burst((port, "/v1"), 64, 4))
                    out.append(f"burst p50 {common.pct(bursts['ttft'], .5)*1e3:.1f} ms")
                    print(' | '.join(out), flush=True)


if __name__ == "__main__":
    main()
