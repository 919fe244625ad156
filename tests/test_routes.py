"""Routing on real sockets: two simulators, models routed by name and glob, load shared by requests
in flight, an unknown model answered clearly, SIGHUP reloads that drop no stream, a broken file
refused while the old routes keep serving."""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest
import yaml

from servers import Process, Simulator, scraped
from proxy.processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def routes(a: Simulator, b: Simulator, alpha: str = "a") -> str:
    return yaml.safe_dump({
        "upstreams": [{"name": "a", "url": f"{a.url}/v1"}, {"name": "b", "url": f"{b.url}/v1", "connect_timeout": 5}],
        "routes": [{"models": ["alpha"], "upstreams": [alpha]}, {"models": ["beta-*"], "upstreams": ["b"]},
                   {"models": ["shared"], "upstreams": ["a", "b"]}],
    })


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    a, b = Simulator(), Simulator()
    path = tmp_path_factory.mktemp("routes") / "routes.yaml"
    path.write_text(routes(a, b))
    port = free_port()
    proxy = Process(["serve", "--routes", str(path), "--port", str(port)], f"http://127.0.0.1:{port}/healthz")
    try:
        yield {"a": a, "b": b, "path": path, "proxy": proxy, "url": f"http://127.0.0.1:{port}"}
    finally:
        proxy.stop()
        a.proc.stop()
        b.proc.stop()


def chat(url: str, model: str, tokens: int = 3, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def requests_seen(sim: Simulator) -> int:
    return sim.stats()["requests"]


def test_each_model_reaches_its_upstream_with_its_label(fleet):
    a, b, url = fleet["a"], fleet["b"], fleet["url"]
    before = requests_seen(a), requests_seen(b)
    assert chat(url, "alpha").status_code == 200
    assert chat(url, "beta-7b").status_code == 200  # a glob
    assert (requests_seen(a) - before[0], requests_seen(b) - before[1]) == (1, 1)
    time.sleep(0.3)  # the finisher
    assert scraped(url, "llmproxy_requests_total", model="alpha", upstream="a", outcome="ok") >= 1
    assert scraped(url, "llmproxy_requests_total", model="beta-7b", upstream="b", outcome="ok") >= 1
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["alpha", "shared"]  # exact names; globs are not models


def test_an_unknown_model_is_a_clear_404(fleet):
    response = chat(fleet["url"], "gamma")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "gamma" in error["message"] and error["type"] == "invalid_request_error"


def test_two_upstreams_for_one_model_share_by_requests_in_flight(fleet):
    a, b, url = fleet["a"], fleet["b"], fleet["url"]
    before = requests_seen(a), requests_seen(b)
    with ThreadPoolExecutor(20) as pool:  # 20 streams of 1 s at once: each goes to the less busy upstream
        statuses = list(pool.map(lambda _: chat(url, "shared", 20, {"x-sim-decode-tps": "20"}).status_code, range(20)))
    assert statuses == [200] * 20
    share = (requests_seen(a) - before[0], requests_seen(b) - before[1])
    assert sum(share) == 20 and min(share) >= 8, share


def test_sighup_reload_drops_no_stream_and_a_broken_file_is_refused(fleet):
    a, b, url, path, proxy = fleet["a"], fleet["b"], fleet["url"], fleet["path"], fleet["proxy"]
    results: list[tuple[int, int]] = []

    def stream(_: int) -> None:
        body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-sim-decode-tps": "20"}, timeout=60) as r:
            tokens = sum(line.count('"content":" ') for line in r.iter_lines())
            results.append((r.status_code, tokens))

    before_b = requests_seen(b)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    time.sleep(0.8)  # every stream is running on upstream a (2 s each)
    path.write_text(routes(a, b, alpha="b"))
    proxy.process.send_signal(signal.SIGHUP)
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 20 and all(status == 200 and tokens == 40 for status, tokens in results), results
    assert requests_seen(b) == before_b  # the running streams stayed on a
    assert chat(url, "alpha").status_code == 200 and requests_seen(b) == before_b + 1  # new ones follow the new routes
    path.write_text("upstreams: [this is: not: valid")
    proxy.process.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proxy.process.poll() is None
    assert chat(url, "alpha").status_code == 200 and requests_seen(b) == before_b + 2  # the old routes keep serving
    path.write_text(routes(a, b))
    proxy.process.send_signal(signal.SIGHUP)


def test_a_broken_routes_file_stops_the_start_with_one_clear_line(tmp_path):
    import subprocess
    import sys

    from servers import ROOT

    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"upstreams": [{"name": "a", "url": "http://127.0.0.1:1/v1"}], "routes": [{"models": ["x"], "upstreams": ["nope"]}]}))
    out = subprocess.run([sys.executable, "-m", "proxy", "serve", "--routes", str(path), "--port", str(free_port())], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "names unknown upstreams ['nope']" in out.stderr


@pytest.mark.parametrize("route, words", [
    ({"first_token_dedline": 2.0}, "line 7: route has unknown keys ['first_token_dedline']"),  # a typo is not silently no failover
    ({"first_token_deadline": -1}, "line 7: first_token_deadline must be a positive number"),
    ({"retries": "two"}, "line 7: retries must be a whole number"),
    ({"pick": "fastest"}, "line 7: pick must be one of fewest_in_flight, predicted_ttft"),
    ({"retry_budget": {"ratio": -0.1}}, "line 7: retry_budget's ratio must be"),
])
def test_every_key_of_a_route_is_checked_and_a_wrong_one_refused_with_its_line(tmp_path, route, words):
    from proxy.config import Settings
    from proxy.fleet.routes import Router

    path = tmp_path / "routes.yaml"
    good = {"upstreams": [{"name": "a", "url": "http://127.0.0.1:9/v1"}, {"name": "b", "url": "http://127.0.0.1:10/v1"}],
            "routes": [{"models": ["m"], "upstreams": ["a", "b"], "first_token_deadline": 2.0, "retries": 1, "pick": "predicted_ttft"}]}
    path.write_text(yaml.safe_dump(good, sort_keys=False))
    router = Router(Settings(routes=str(path)))
    rule = router.route("m")
    assert (rule.first_token_deadline, rule.retries, rule.pick) == (2.0, 1, "predicted_ttft")
    broken = {**good, "routes": [{"models": ["m"], "upstreams": ["a", "b"], **route}]}
    path.write_text(yaml.safe_dump(broken, sort_keys=False))
    with pytest.raises(ValueError) as error:
        router.reload()
    assert words in str(error.value), str(error.value)
    assert router.route("m") is rule  # the old routes keep serving
    path.write_text(yaml.safe_dump({**good, "colour": "blue"}, sort_keys=False))
    with pytest.raises(ValueError, match="line 1: unknown keys \\['colour'\\]"):
        router.reload()
    path.write_text(yaml.safe_dump({**good, "upstreams": [{"name": "a", "url": "http://127.0.0.1:9/v1", "read_timout": 5}]}, sort_keys=False))
    with pytest.raises(ValueError, match="line 2: upstream 'a' has unknown keys \\['read_timout'\\]"):
        router.reload()
    # The file's ejection policy: checked likewise; a good one applies to the replicas kept, their health kept.
    health = router.upstreams["a"].health
    path.write_text(yaml.safe_dump({**good, "ejection": {"base_time": 5, "consecutive_failure": 2}}, sort_keys=False))
    with pytest.raises(ValueError, match="line 16: ejection must be `off` or a map of"):
        router.reload()
    path.write_text(yaml.safe_dump({**good, "ejection": {"base_time": 5}}, sort_keys=False))
    router.reload()
    assert router.upstreams["a"].health is health and health.spec.base_s == 5.0 and health.spec.consecutive == 5
    router.close()
