"""Overload and resource hygiene, on real sockets and real processes: bursts leak no descriptor,
exhaustion is the proxy's (503 proxy_overloaded, never 502), the open files limit is raised, and
--max-in-flight sheds the excess at once."""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from servers import ROOT, Process, Simulator, descriptors_exhausted, scraped, sockets_to
from proxy.processes import free_port

sys.path.insert(0, str(ROOT))
from bench.truth.burst import Peak, descriptors, run_burst, settle  # noqa: E402

pytestmark = [pytest.mark.e2e]


class Proxy(Process):
    """`python -m proxy serve` in front of `upstream`, on a port of its own."""

    def __init__(self, upstream: str, *args: str, nofile: tuple[int, int] | None = None, log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(["serve", "--upstream", upstream, "--port", str(self.port), *args], f"{self.url}/healthz",
                         nofile=nofile, log=log)

    @property
    def pid(self) -> int:
        return self.process.pid

    def metric(self, name: str, **labels: str) -> float:
        return scraped(self.url, name, **labels)


@pytest.fixture
def spawn() -> Iterator[Any]:
    started: list[Any] = []

    def make(kind: type, *args: Any, **kwargs: Any) -> Any:
        started.append(kind(*args, **kwargs))
        return started[-1]

    yield make
    for thing in reversed(started):
        (thing.proc if isinstance(thing, Simulator) else thing).stop()


@pytest.mark.parametrize("upstream_keepalive", ["5", "never"])
def test_a_burst_leaves_no_descriptor_and_no_close_wait(spawn, upstream_keepalive):
    """400 streams at once, against an upstream that closes idle connections after 5 s (uvicorn's
    default, as vLLM) and one that never does: within 10 s the proxy is back at its idle baseline."""
    sim = spawn(Simulator, "--decode-tps", "50", "--keep-alive-timeout", "5" if upstream_keepalive == "5" else "3600")
    proxy = spawn(Proxy, f"{sim.url}/v1")
    time.sleep(1.5)  # the descriptor sampler and the offload worker are up
    baseline = descriptors(proxy.pid)
    with Peak(proxy.pid) as peak:
        result = run_burst(f"{proxy.url}/v1", 400, max_tokens=10)
    assert result.statuses == {200: 400}, (result.statuses, result.codes, result.transport)
    took, fds, waiting = settle(proxy.pid, baseline, within=10.0)
    print(f"\nupstream keep-alive {upstream_keepalive}: baseline {baseline} descriptors, peak {peak.most} during the burst, "
          f"{fds} {took if took is None else round(took, 1)} s after it, CLOSE-WAIT {waiting}")
    assert peak.most > baseline + 700, "400 client and 400 upstream sockets at once"  # (so the check below means something)
    assert took is not None, f"10 s after the burst: {fds} descriptors (idle baseline {baseline}), {waiting} in CLOSE-WAIT"


def test_out_of_descriptors_is_a_503_naming_the_proxy_never_a_502(spawn, tmp_path):
    """RLIMIT_NOFILE 256 for the proxy alone (soft = hard, so it cannot raise it), a pool set above what
    that holds (--max-connections 1000) and 400 streams at once: every request that fails gets 503
    proxy_overloaded with Retry-After, none a 502 and none a reset connection; the proxy warns about
    the limit at start and serves normally afterwards. (With the default pool, sized from the limit,
    the excess is refused as `pool` instead: test_the_default_pool_sheds_what_the_limit_cannot_hold.)"""
    sim = spawn(Simulator, "--decode-tps", "50")
    log = tmp_path / "proxy.log"
    proxy = spawn(Proxy, f"{sim.url}/v1", "--log-level", "info", "--max-connections", "1000", nofile=(256, 256), log=log)
    result = run_burst(f"{proxy.url}/v1", 400, max_tokens=10)
    print(f"\nRLIMIT_NOFILE 256, 400 streams: statuses {dict(result.statuses)}, codes {dict(result.codes)}, "
          f"no response {dict(result.transport)}")
    assert not result.transport, "a client got no HTTP answer (reset or refused)"
    assert 502 not in result.statuses and "upstream_connect_error" not in result.codes
    assert result.statuses[503] > 0, "the burst was meant to exhaust descriptors"
    assert set(result.statuses) <= {200, 503} and result.codes == {"proxy_overloaded": result.statuses[503]}
    assert result.retry_after == {"1"}
    assert proxy.metric("llmproxy_requests_rejected_total", reason="descriptors") == result.statuses[503]
    assert proxy.metric("llmproxy_requests_total", outcome="upstream_error") == 0
    assert proxy.metric("llmproxy_max_fds") == 256
    after = run_burst(f"{proxy.url}/v1", 5, max_tokens=5)
    assert after.statuses == {200: 5}
    text = log.read_text()
    assert "open files limit: 256 (soft limit was 256, hard limit 256): 96 streams at once in this process" in text
    assert "open files limit 256 is below the 2064 that --max-connections 1000" in text


def test_the_default_pool_sheds_what_the_limit_cannot_hold(spawn, tmp_path):
    """The same 256 open files and 400 streams with default flags: the pool is sized from the limit
    (96 streams), so nothing waits in a queue nobody asked for; the excess gets an immediate 503
    naming the proxy's pool (or its descriptors), never a 502, a 504 or a reset."""
    sim = spawn(Simulator, "--decode-tps", "50")
    log = tmp_path / "proxy.log"
    proxy = spawn(Proxy, f"{sim.url}/v1", "--log-level", "info", nofile=(256, 256), log=log)
    result = run_burst(f"{proxy.url}/v1", 400, max_tokens=10)
    assert not result.transport, "a client got no HTTP answer (reset or refused)"
    # (about the pool's 96 served: a few may meet the descriptor limit first, the clients' accepted sockets counting
    # against the same 256, and are refused for descriptors, as asserted below)
    assert set(result.statuses) <= {200, 503} and result.statuses[200] >= 90
    assert result.codes == {"proxy_overloaded": result.statuses[503]}
    pool, fds = (proxy.metric("llmproxy_requests_rejected_total", reason=r) for r in ("pool", "descriptors"))
    assert pool + fds == result.statuses[503] > 0  # (which limit a request meets first is the kernel's timing: either, never both missing)
    assert proxy.metric("llmproxy_upstream_pool_waits_total", result="refused") == pool
    assert proxy.metric("llmproxy_upstream_pool_limit") == 96
    text = log.read_text()
    assert "96 streams at once in this process, the upstream pool 96" in text and "is below" not in text


def test_the_soft_limit_is_raised_to_the_hard_one(spawn, tmp_path):
    sim = spawn(Simulator)
    log = tmp_path / "proxy.log"
    proxy = spawn(Proxy, f"{sim.url}/v1", "--log-level", "info", "--max-connections", "500", nofile=(256, 4096), log=log)
    limits = Path(f"/proc/{proxy.pid}/limits").read_text()
    soft, hard = next(line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files"))
    assert (soft, hard) == ("4096", "4096")
    text = log.read_text()
    assert "open files limit: 4096 (soft limit was 256, hard limit 4096): 2016 streams at once in this process, the upstream pool 500" in text
    assert "is below" not in text  # 4096 covers 500 upstream + 500 client connections
    assert proxy.metric("llmproxy_max_fds") == 4096


def test_max_in_flight_sheds_the_excess_at_once_and_admitted_streams_finish(proxy_factory, sim):
    proxy = proxy_factory(max_in_flight=2)
    client = openai.OpenAI(base_url=proxy.v1, api_key="k", max_retries=0)
    slow = [client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=60,
                                           extra_headers={"x-sim-decode-tps": "30"}) for _ in range(2)]
    firsts = [next(iter(stream)) for stream in slow]  # both admitted and streaming (2 s each)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    answered_in = time.monotonic() - start
    assert refused.value.status_code == 503 and answered_in < 1.0  # not queued behind the 2 s streams
    assert refused.value.body["code"] == "proxy_overloaded" and "--max-in-flight" in refused.value.body["message"]
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.response.headers.get("connection") != "close"  # shedding keeps the client's connection
    for stream in slow:
        assert sum(1 for _ in stream) > 50  # admitted streams run to their end
    assert firsts and client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5).choices
    records = proxy.wait_records(4)
    rejected = [r for r in records if r["outcome"] == "overloaded"]
    assert len(rejected) == 1 and rejected[0]["status_code"] == 503 and rejected[0]["error"] == "proxy_overloaded:max_in_flight"
    label = proxy.settings.upstream_label
    assert proxy.sample("llmproxy_requests_rejected_total", {"upstream": label, "reason": "max_in_flight"}) == 1
    assert proxy.sample("llmproxy_max_in_flight", {"upstream": label}) == 2
    assert proxy.app.admission.in_flight == 0


def test_running_out_of_descriptors_while_connecting_is_503(proxy_factory, sim):
    """The kernel's own EMFILE on the upstream connect: this process's soft limit is lowered to its
    highest open descriptor and every free one below is taken, so the proxy's next socket() fails,
    while the client reuses its connection to the proxy (no new descriptor on that side)."""
    proxy = proxy_factory(keepalive_expiry=0.0)  # no pooled upstream connection to fall back on
    gc.collect()
    others = sockets_to(sim.port)  # (earlier tests' clients of the simulator, in this process too)
    with httpx.Client(base_url=proxy.v1, timeout=10) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert client.post("/chat/completions", json=body).status_code == 200
        # The client has its answer before the proxy's loop closes the upstream socket (a closed
        # transport's descriptor goes on the loop's next turn): one closed after the block took
        # every free descriptor would be the proxy's to reuse.
        deadline = time.monotonic() + 5
        while sockets_to(sim.port) > others and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sockets_to(sim.port) == others
        with descriptors_exhausted():  # the proxy's next socket() is EMFILE
            refused = client.post("/chat/completions", json=body)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "proxy_overloaded" and "file descriptor" in error["message"]
        assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
    with httpx.Client(base_url=proxy.v1, timeout=10) as client:
        assert client.post("/chat/completions", json=body).status_code == 200
    record = [r for r in proxy.wait_records(3) if r["status_code"] == 503][0]
    assert record["outcome"] == "overloaded" and record["error"] == "proxy_overloaded:descriptors"
    assert proxy.sample("llmproxy_requests_total", {"model": "m", "upstream": proxy.settings.upstream_label, "endpoint": "chat",
                                                    "stream": "false", "outcome": "upstream_error", "code": "502"}) is None
