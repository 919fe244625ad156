"""Real parts for end-to-end tests: a simulator process, the proxy under uvicorn on a real socket."""
from __future__ import annotations

import gc
import shutil
import os
import resource
import socket
import struct
import subprocess
import tempfile
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import yaml
import uvicorn
from opentelemetry.trace import SpanKind
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from proxy.serve.server import GuardedHttpTools
from proxy.serve.app import ProxyApp
from proxy.config import Settings
from proxy.processes import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


class Process:
    """`python -m proxy ARGS` as a child process, waited on until healthy; optionally under its own
    RLIMIT_NOFILE (set in the child only) and with its output kept in `log`."""

    def __init__(self, args: list[str], health: str, env: dict[str, str] | None = None, verify: str | bool = True,
                 nofile: tuple[int, int] | None = None, log: Path | None = None) -> None:
        if log is not None:
            self.log = open(log, "wb")
        else:
            self.log = open(os.devnull, "wb") if not os.environ.get("LLMPROXY_TEST_LOGS") else None

        def limit() -> None:  # in the child, before it runs anything
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.process = subprocess.Popen([sys.executable, "-m", "proxy", *args], cwd=ROOT, env={**os.environ, **(env or {})},
                                        stdout=self.log, stderr=subprocess.STDOUT if self.log else None, preexec_fn=limit)
        wait_healthy(health, self.process, verify=verify)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if self.log:
            self.log.close()


def scraped(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on `url`/metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sockets_to(port: int) -> int:
    """How many of this process's sockets are connected to `port` (its descriptors' inodes looked up
    in the kernel's TCP tables): a closed transport's socket stays open until its loop's next turn."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (by the proxy's loop thread)
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in mine:
                    count += 1
    return count


@contextmanager
def descriptors_exhausted(spare: int = 0) -> Iterator[None]:
    """No descriptor free in this process (`spare` left free) until the block ends: the soft
    RLIMIT_NOFILE lowered to the highest open descriptor, every free one below it taken, so the
    kernel's next socket() or accept() is EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    gc.collect()  # (sockets earlier tests left to the collector close now, not mid-test)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    fillers: list[int] = []
    try:
        while True:
            try:
                fillers.append(os.dup(0))
            except OSError:
                break
        for _ in range(spare):
            os.close(fillers.pop())
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# How late a stamp may be when another process holds the CPU: on 2 cores with the client, the proxy,
# the simulator and a test runner all busy, a scheduler slice (a few ms, seen up to 4 under an extra
# CPU hog). The typical stamp is ~0.1 ms late (bench/truth/stamps.py); medians are held to that.
SCHEDULER_SLACK_S = 0.010


class Delivered:
    """What the simulator really did on its last stream, on its monotonic clock (the proxy's too). A
    loaded machine starts a write some ms after the injected schedule; a figure held to the schedule
    would fail on the machine, not on the proxy, so tests hold the proxy's figures to this."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self.received: float = stats["last_received"]
        self.writes: list[float] = [before for before, _ in stats["last_send_times"]]

    def __repr__(self) -> str:  # (what a failed assertion prints)
        return f"Delivered(ttft {self.ttft_s * 1e3:.2f} ms, window {self.window_s() * 1e3:.2f} ms, {len(self.writes)} writes)"

    @property
    def ttft_s(self) -> float:
        return self.writes[0] - self.received

    def window_s(self, choice: int = 0, choices: int = 1) -> float:
        """First to last content write of one choice (the simulator interleaves n choices' chunks)."""
        writes = self.writes[choice::choices]
        return writes[-1] - writes[0]

    def holds_ttft(self, record: dict[str, Any]) -> bool:
        """The proxy's TTFT, less the client's upload (its `client` phase: the first request of a
        fresh client process can take ms between head and body), starts before the simulator's (the
        hop there) and ends after it (the read)."""
        return -0.0001 <= record["ttft_s"] - record["phases_s"]["client"] - self.ttft_s <= SCHEDULER_SLACK_S

    def holds_window(self, window_s: float, choice: int = 0, choices: int = 1) -> bool:
        """The proxy's decode window is the simulator's, give or take a late stamp at either end:
        5 ms, under the shortest gap between tokens the tests inject (10 ms)."""
        return abs(window_s - self.window_s(choice, choices)) <= 0.005

    def holds_rate(self, tokens_per_s: float, after: int, choice: int = 0, choices: int = 1) -> bool:
        """`after` tokens (those after the first chunk) over the simulator's window, within
        `holds_window`: one token miscounted fails."""
        return self.holds_window(after / tokens_per_s, choice, choices)


class Simulator:
    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Process(["simulate", "--port", str(self.port), "--deterministic", *extra], f"{self.url}/health")

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/sim/stats").json()

    def delivered(self) -> Delivered:
        return Delivered(self.stats())

    def configure(self, **values: Any) -> None:
        httpx.post(f"{self.url}/sim/config", json=values).raise_for_status()



@contextmanager
def simulators(n: int) -> Iterator[list[Simulator]]:
    """`n` simulated replicas, stopped after."""
    sims = [Simulator() for _ in range(n)]
    try:
        yield sims
    finally:
        for each in sims:
            each.proc.stop()

class SpanCounter(SpanProcessor):
    """Counts the SERVER spans that reached the processors: one per traced request, never fewer."""

    def __init__(self) -> None:
        self.ended = 0
        self.servers = 0

    def on_end(self, span) -> None:  # type: ignore[no-untyped-def]
        self.ended += 1
        self.servers += span.kind == SpanKind.SERVER


class ProxyServer:
    """The proxy app in this process (so tests see its spans and registry), on a real socket."""

    def __init__(self, upstream: str, http: Any = GuardedHttpTools, **settings: Any) -> None:
        """`http`: the server's protocol (another, e.g. uvicorn's own "httptools", stands for another ASGI server)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A records file of its own: the default is one per port, and a port freed by an earlier test's
        # proxy may come round again in the same session with that proxy's records in its file.
        settings.setdefault("records_db", os.path.join(tempfile.mkdtemp(prefix="llmproxy-test-records-"), "records.sqlite"))
        self.settings = Settings(upstream=upstream, port=self.port, **settings)
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.spans = SpanCounter()
        provider.add_span_processor(self.spans)
        self.registry = CollectorRegistry()
        self.app = ProxyApp(self.settings, registry=self.registry, tracer_provider=provider)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, loop="proxy.serve.acceptor:new_event_loop", http=http,
                                timeout_graceful_shutdown=self.settings.shutdown_grace,
                                log_level="warning", access_log=False, server_header=False, date_header=False, proxy_headers=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("proxy did not start")
            time.sleep(0.02)

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def records(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/llmproxy/requests", params={"limit": 1000}).json()

    def last_record(self, timeout: float = 5.0) -> dict[str, Any]:
        """The newest record: waits until no request is in flight or queued for export (the finish
        runs just after the last byte, and exports from the finisher task), then for one record."""
        deadline = time.monotonic() + timeout
        while (self.in_flight() or not self.app.telemetry.idle) and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.wait_records(1, max(0.0, deadline - time.monotonic()))[-1]

    def wait_records(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """At least `count` records, or an assertion: a count that never comes is a test's mistake, and waiting out
        its timeout in silence cost the suite 15 s of nothing (two such waits, found and fixed)."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.records()
            if len(records) >= count:
                return records
            assert time.monotonic() < deadline, f"{len(records)} records after {timeout} s, not {count}"
            time.sleep(0.01)

    def sample(self, name: str, labels: dict[str, str]) -> float | None:
        if name == "llmproxy_requests_total" and "api" not in labels:  # (most tests speak OpenAI's API)
            labels = {**labels, "api": "openai"}
        if name.startswith(TENANTED) and "tenant" not in labels:  # (most tests name no tenant: `unknown`)
            labels = {**labels, "tenant": "unknown"}
        return self.registry.get_sample_value(name, labels)

    def in_flight(self) -> float:
        return self.sample("llmproxy_requests_in_flight", {"upstream": self.settings.upstream_label}) or 0.0

    def assert_all_finished(self, timeout: float = 5.0) -> None:
        """Every request finished: the in-flight gauge back at 0, every traced request's spans exported."""
        deadline = time.monotonic() + timeout
        tracing = self.app.telemetry.tracing
        while (self.in_flight() or tracing.started != self.spans.servers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.in_flight() == 0, "a request never finished: the in-flight gauge is not back at 0"
        assert tracing.started == self.spans.servers, f"{tracing.started - self.spans.servers} traced requests sent no spans"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


TENANTED = ("llmproxy_requests_total", "llmproxy_time_to_first_token_seconds", "llmproxy_request_duration_seconds",
            "llmproxy_decode_tokens_per_second", "llmproxy_slo_requests_total", "llmproxy_slo_misses_total",
            "llmproxy_requests_rejected_total")


class RawUpstream:
    """A real HTTP/1.1 upstream on loopback that answers every request with given bytes: each write
    as its own chunk, `gap_s` apart (recorded streams, compressed or hostile ones). `close`: the
    connection drops before the last chunk (a truncated stream). `then`: the answer says nothing of
    closing, but the connection is closed as the next request on it arrives, unanswered, with a FIN
    ("fin") or a reset ("reset"): llama.cpp's way after a stream, its close caught mid-flight. The
    requests it saw are kept."""

    def __init__(self, writes: list[bytes], gap_s: float = 0.0, close: bool = False, headers: list[tuple[str, str]] | None = None,
                 content_type: str = "text/event-stream", chunked: bool = True, status: int = 200, then: str = "") -> None:
        self.writes, self.gap_s, self.close, self.chunked, self.status, self.then = writes, gap_s, close, chunked, status, then
        self.headers = [("content-type", content_type), *(headers or [])]
        self.requests: list[dict[str, str]] = []
        self.accepted = 0  # connections
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                part = conn.recv(65536)
                if not part:
                    return
                data += part
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(fields.get("content-length", "0"))
            while len(rest) < length:
                rest += conn.recv(65536)
            self.requests.append({"request-line": lines[0], **fields})
            framing = [("transfer-encoding", "chunked")] if self.chunked else [("content-length", str(sum(map(len, self.writes))))]
            closing = "" if self.then else "connection: close\r\n"
            response = f"HTTP/1.1 {self.status} OK\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.headers + framing) + closing + "\r\n"
            try:
                conn.sendall(response.encode())
                for index, write in enumerate(self.writes):
                    if self.gap_s:
                        time.sleep(self.gap_s)
                    conn.sendall(b"%x\r\n%s\r\n" % (len(write), write) if self.chunked else write)
                    if self.close and index == len(self.writes) - 1:
                        return
                if self.chunked:
                    conn.sendall(b"0\r\n\r\n")
                if self.then and conn.recv(65536):  # the next request came: it is not answered
                    if self.then == "reset":
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return
                    conn.shutdown(socket.SHUT_WR)
                    conn.settimeout(5)
                    while conn.recv(65536):  # (read to the peer's close: nothing left unread, so no reset)
                        pass
            except OSError:
                return

    def stop(self) -> None:
        self.listener.close()


@contextmanager
def raw_upstream(writes: list[bytes], gap_s: float = 0.0, **kwargs: Any) -> Iterator[RawUpstream]:
    upstream = RawUpstream(writes, gap_s, **kwargs)
    try:
        yield upstream
    finally:
        upstream.stop()


class Prometheus:
    """Debian's Prometheus scraping `targets` every second with `rule_file`, optionally sending
    alerts to an Alertmanager (re-sent every second, so a resolved alert reaches it at once)."""

    def __init__(self, workdir: Path, targets: list[str], rule_file: Path, alertmanager: str = "") -> None:
        exe = shutil.which("prometheus")
        assert exe, "prometheus missing: run `make test` (it installs Debian's prometheus package)"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rule_file)],
                  "scrape_configs": [{"job_name": "llm-latency-proxy", "static_configs": [{"targets": targets}]}]}
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen(
            [exe, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn", "--rules.alert.resend-delay=1s"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(f"{self.url}/-/ready", self.process, timeout=30)
        deadline = time.monotonic() + 30
        # Service discovery hands targets to the scraper only after a few seconds: wait for a scrape of each.
        while len(self.query("up == 1")["result"]) < len(targets):
            assert time.monotonic() < deadline, "prometheus never scraped the proxy"
            time.sleep(0.2)

    def query(self, expr: str) -> dict[str, Any]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]

    def alerts(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=15)


class Postgres:
    """Debian's PostgreSQL in a cluster of the test's own: a fresh data folder, password
    (scram-sha-256) authentication on 127.0.0.1, run as the `postgres` user when the suite runs as
    root (PostgreSQL refuses root). `stop` and `start` for outages; `dsn` holds no password (the
    proxies read it from `password_file`, as a Kubernetes Secret would be mounted)."""

    USER, DATABASE = "llmproxy", "postgres"

    def __init__(self, password: str = "pg-SECRET-7f3a9c-do-not-log") -> None:
        import glob
        import pwd
        import tempfile

        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        assert found, "PostgreSQL missing: run `make test` (it installs Debian's postgresql package)"
        self.bindir = str(Path(found[-1]).parent)
        self.password, self.port = password, free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="llmproxy-pg-"))  # (under /tmp: the postgres user can reach it)
        self.run_as: list[str] = []
        owner = None
        if os.getuid() == 0:
            owner = pwd.getpwnam("postgres")
            self.run_as = ["runuser", "-u", "postgres", "--"]
        self.password_file = self.dir / "password"
        self.password_file.write_text(password + "\n")
        if owner is not None:
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
            os.chown(self.password_file, owner.pw_uid, owner.pw_gid)
        self.data = self.dir / "data"
        subprocess.run([*self.run_as, f"{self.bindir}/initdb", "-D", str(self.data), "-U", self.USER, "--auth=scram-sha-256",
                        f"--pwfile={self.password_file}", "-E", "UTF8", "--no-sync"], check=True, capture_output=True, timeout=120)
        self.start()

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.USER}@127.0.0.1:{self.port}/{self.DATABASE}"

    def _ctl(self, *args: str) -> None:
        subprocess.run([*self.run_as, f"{self.bindir}/pg_ctl", "-D", str(self.data), *args], check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        # fsync off: a test cluster's durability is not under test; its availability is.
        self._ctl("-l", str(self.dir / "server.log"), "-w", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "-w", "stop")

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.dsn, password=self.password, autocommit=True) as conn:
            cursor = conn.execute(sql, args or None)
            return cursor.fetchall() if cursor.description else []

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass  # (already stopped)
        shutil.rmtree(self.dir, ignore_errors=True)


class TinyProxy:
    """Debian's tinyproxy: a real forward proxy on loopback, with Basic authentication (CONNECT to
    every port allowed), its log read back for what it was asked to do."""

    def __init__(self, workdir: Path, user: str = "proxyuser", password: str = "proxy-SECRET-5d4c") -> None:
        exe = shutil.which("tinyproxy")
        assert exe, "tinyproxy missing: run `make test` (it installs Debian's tinyproxy package)"
        self.port, self.user, self.password = free_port(), user, password
        workdir.mkdir(parents=True, exist_ok=True)
        self.logfile = workdir / "tinyproxy.log"
        config = workdir / "tinyproxy.conf"
        config.write_text(f'Port {self.port}\nListen 127.0.0.1\nTimeout 60\nLogFile "{self.logfile}"\nLogLevel Connect\nMaxClients 200\n'
                          f"BasicAuth {user} {password}\nDisableViaHeader Yes\n")
        os.chmod(workdir, 0o777)  # (it may drop privileges to nobody when started as root)
        self.process = subprocess.Popen([exe, "-d", "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and self.process.poll() is None, "tinyproxy did not start"
                time.sleep(0.05)

    def url(self, credentials: bool = True) -> str:
        return f"http://{self.user}:{self.password}@127.0.0.1:{self.port}" if credentials else f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[str]:
        """The request lines it received ("CONNECT host:port HTTP/1.1", "GET http://… HTTP/1.1")."""
        text = self.logfile.read_text() if self.logfile.exists() else ""
        return [line.split("): ", 1)[1] for line in text.splitlines() if "Request (file descriptor" in line]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


class SilentRelay:
    """A TCP relay on loopback in front of a server, as a failover manager's address is: `freeze()` stops forwarding on
    the connections it holds (they stay open and silent, no reset: a primary gone behind the same address, a pooler
    that keeps acknowledging), while connections made after it reach the live server."""

    def __init__(self, port: int) -> None:
        import socket as sockets

        self.target, self.port = port, free_port()
        self.listener = sockets.create_server(("127.0.0.1", self.port))
        self.generation = 0  # connections of an older generation are frozen
        self.held: list[Any] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self.generation += 1

    def _accept(self) -> None:
        import socket as sockets

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = sockets.create_connection(("127.0.0.1", self.target))
            self.held += [client, server]
            born = self.generation
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b, born), daemon=True).start()

    def _pump(self, source: Any, sink: Any, born: int) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            while born != self.generation:  # frozen: read, never forwarded, never closed
                time.sleep(3600)
            try:
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()
        for each in self.held:
            try:
                each.close()
            except OSError:
                pass
