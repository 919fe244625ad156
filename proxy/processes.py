"""The demo's, tests' and benchmarks' child processes: a free loopback port, a process healthy before it is used,
and the proxy's command from a given checkout (a before/after on one machine)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from typing import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 60.0, verify: str | bool = True,
                 headers: dict[str, str] | None = None) -> None:
    if isinstance(verify, str):  # a CA bundle file (a test's self-signed upstream)
        import ssl

        verify = ssl.create_default_context(cafile=verify)  # type: ignore[assignment]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1.0, verify=verify, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


@contextlib.contextmanager
def started(args: list[str], health_url: str, env: dict[str, str] | None = None, command: list[str] | None = None,
            headers: dict[str, str] | None = None, quiet: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m proxy ARGS` (or `command`) as a child process, healthy before the body runs."""
    out = subprocess.DEVNULL if quiet else None
    process = subprocess.Popen(command or [sys.executable, "-m", "proxy", *args], env={**os.environ, **(env or {})},
                               stdout=out, stderr=out)
    try:
        wait_healthy(health_url, process, timeout=120, headers=headers)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def serve_command(src: str, *args: str) -> list[str]:
    """`llm-latency-proxy ARGS` run from the checkout at `src` (benchmarks: a before/after on one machine). `src` goes
    first on the path of any fresh interpreter it starts too: a checkout whose records writer runs under a fork server
    (which does not take its parent's path, on Python 3.11) imported the `outbox` of the working directory or of the
    installed checkout, so before/after runs measured this tree's records process for both, or none at all (a
    writer process of another version, crashing at its start)."""
    where = os.path.abspath(src)
    return [sys.executable, "-c", f"import os, sys; sys.path.insert(0, {where!r}); "
            f"os.environ.update(PYTHONSAFEPATH='1', PYTHONPATH=os.pathsep.join(filter(None, [{where!r}, os.environ.get('PYTHONPATH')]))); "
            "from proxy.cli import main; sys.exit(main())", *args]
