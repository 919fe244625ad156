"""Azure OpenAI through the proxy with the official `openai.AzureOpenAI` client (deployment paths,
`/openai/v1/`, `api-version`, the `api-key` header), and every other path relayed untouched."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest

from proxy.config import Settings
from proxy.upstream.pool import Pool
from servers import raw_upstream

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "user", "content": "hello there"}]


def azure(server, key: str = "azure-key") -> openai.AzureOpenAI:
    return openai.AzureOpenAI(azure_endpoint=server.url, api_key=key, api_version="2024-10-21", max_retries=0)


def test_deployment_paths_are_measured_like_chat(proxy_factory, sim):
    proxy = proxy_factory(upstream=sim.url)  # Azure's resource URL: an origin, no path
    chunks = list(azure(proxy).chat.completions.create(model="gpt-4o-prod", messages=MESSAGES, max_tokens=51, stream=True,
                                                       extra_headers={"x-sim-ttft-ms": "200", "x-sim-decode-tps": "50"}))
    assert all(c.usage is None for c in chunks)  # the usage chunk the proxy asked for never reaches the client
    record = proxy.last_record()
    assert record["api"] == "azure" and record["endpoint"] == "chat" and record["model"] == "gpt-4o-prod"
    delivered = sim.delivered()
    assert delivered.holds_ttft(record) and delivered.holds_rate(record["decode_tokens_per_second"], 50)
    assert record["completion_tokens"] == 51 and record["token_source"] == "usage" and record["outcome"] == "ok"
    seen = sim.stats()["last_headers"]
    assert seen["api-key"] == "azure-key" and "authorization" not in seen  # forwarded as it came
    assert proxy.sample("llmproxy_requests_total", {"model": "gpt-4o-prod", "upstream": proxy.settings.upstream_label, "endpoint": "chat",
                                                    "stream": "true", "api": "azure", "outcome": "ok", "code": "200"}) == 1
    done = azure(proxy).chat.completions.create(model="gpt-4o-prod", messages=MESSAGES, max_tokens=4)
    assert proxy.last_record()["completion_tokens"] == done.usage.completion_tokens == 4
    vectors = azure(proxy).embeddings.create(model="embed-prod", input="hi")
    assert proxy.last_record()["endpoint"] == "embeddings" and proxy.last_record()["prompt_tokens"] == vectors.usage.prompt_tokens


def test_the_v1_base_url_and_the_key_replaced_per_upstream(proxy_factory, sim, monkeypatch, caplog):
    monkeypatch.setenv("AZURE_UPSTREAM_KEY", "azure-upstream-secret")
    proxy = proxy_factory(upstream=sim.url, upstream_api_key_env="AZURE_UPSTREAM_KEY", upstream_api_key="azure-upstream-secret",
                          log_requests=True)
    client = openai.OpenAI(base_url=f"{proxy.url}/openai/v1", api_key="client-secret", max_retries=0,
                           default_headers={"api-key": "client-secret"})
    with caplog.at_level(logging.INFO):
        list(client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5, stream=True))
        record = proxy.last_record()
    assert record["api"] == "azure" and record["endpoint"] == "chat" and record["completion_tokens"] == 5
    seen = sim.stats()["last_headers"]
    assert seen["api-key"] == "azure-upstream-secret" and "authorization" not in seen  # the client's key never goes on
    metrics = httpx.get(f"{proxy.url}/metrics").text
    for secret in ("client-secret", "azure-upstream-secret"):
        assert secret not in caplog.text and secret not in metrics and secret not in str(proxy.records())


def test_api_version_and_paths_reach_the_upstream_untouched(proxy_factory):
    body = b'{"id":"x","object":"chat.completion","model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    with raw_upstream([body], content_type="application/json", chunked=False) as up:
        proxy = proxy_factory(upstream=up.url.removesuffix("/v1"))
        azure(proxy).chat.completions.create(model="dep-1", messages=MESSAGES)
        assert up.requests[-1]["request-line"] == "POST /openai/deployments/dep-1/chat/completions?api-version=2024-10-21 HTTP/1.1"
        assert proxy.last_record()["prompt_tokens"] == 3
        tags = httpx.get(f"{proxy.url}/custom/route?verbose=1", headers={"x-custom": "kept"})
        assert tags.status_code == 200 and tags.content == body  # a path the proxy does not measure: relayed, never 404
        assert up.requests[-1]["request-line"] == "GET /custom/route?verbose=1 HTTP/1.1" and up.requests[-1]["x-custom"] == "kept"
        assert proxy.last_record()["endpoint"] == "other" and proxy.last_record()["api"] == "other"
        assert httpx.delete(f"{proxy.url}/v1beta/things/7").status_code == 200
        assert up.requests[-1]["request-line"] == "DELETE /v1beta/things/7 HTTP/1.1"
        assert httpx.get(f"{proxy.url}/healthz").json()["status"] == "ok"  # the proxy's own paths stay its own
        assert len(up.requests) == 3


def test_the_client_key_guards_every_relayed_path(proxy_factory, sim):
    proxy = proxy_factory(upstream=sim.url, api_key="proxy-key")
    assert httpx.get(f"{proxy.url}/api/tags").status_code == 401
    assert httpx.get(f"{proxy.url}/v1/models", headers={"authorization": "Bearer proxy-key"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        azure(proxy, key="wrong").chat.completions.create(model="d", messages=MESSAGES, max_tokens=2)
    azure(proxy, key="proxy-key").chat.completions.create(model="d", messages=MESSAGES, max_tokens=2)  # api-key carries the proxy's key
    assert "api-key" not in sim.stats()["last_headers"]  # and it is never sent on


@pytest.mark.parametrize("base, path, target", [
    ("http://h:8000/v1", "/v1/chat/completions", "/v1/chat/completions"),
    ("http://h:8000/v1", "/api/tags", "/api/tags"),
    ("http://h:8000", "/v1/chat/completions", "/v1/chat/completions"),
    ("http://h:8000/api/openai/v1beta", "/v1/chat/completions", "/api/openai/v1beta/chat/completions"),
    ("https://r.openai.azure.com", "/openai/deployments/d/chat/completions", "/openai/deployments/d/chat/completions"),
    ("https://r.openai.azure.com/openai/v1", "/v1/chat/completions", "/openai/v1/chat/completions"),
    ("https://r.openai.azure.com/openai/v1", "/openai/deployments/d/chat/completions", "/openai/deployments/d/chat/completions"),
    ("https://r.openai.azure.com/openai/v1", "/openai/v1/responses", "/openai/v1/responses"),
])
def test_path_mapping(base, path, target):
    assert Pool(Settings(upstream=base)).target(path, b"a=1") == f"{target}?a=1".encode()
