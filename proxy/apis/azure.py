"""Azure OpenAI: OpenAI's wire format on Azure's paths, with the key in an `api-key` header.

`openai.AzureOpenAI(azure_endpoint=<proxy>)` sends
`POST /openai/deployments/{deployment}/chat/completions?api-version=…` (also `completions`,
`embeddings`); Azure's newer base URL `/openai/v1/` takes OpenAI's own paths, and the Responses
API lives at `/openai/responses` (with `api-version`) and `/openai/v1/responses`. The query string
goes to the upstream untouched. The model is the body's `model`, else the deployment the path
names. Everything else (events, usage, what the proxy injects and strips) is OpenAI's: it is chat.
Azure adds `prompt_filter_results` / `content_filter_results` chunks with no delta text: not content.
Older api-versions reject `stream_options`; the relay then retries once without it and stops asking.
"""
from __future__ import annotations

from . import Route
from .openai import OpenAI

DEPLOYMENTS = "/openai/deployments/"


class Azure(OpenAI):
    name = "azure"
    provider = "azure.ai.openai"
    key_headers = (b"api-key", b"authorization")  # Entra ID tokens come as Authorization: Bearer
    key_prefix = b""

    def route(self, path: str, query: bytes = b"") -> Route | None:
        if path.startswith("/openai/v1/"):
            return self.operation(path[len("/openai/v1"):])
        if path.startswith(DEPLOYMENTS):
            deployment, slash, rest = path[len(DEPLOYMENTS):].partition("/")
            return self.operation("/" + rest, model=deployment) if slash and deployment else None
        if path.startswith("/openai/responses"):
            return self.operation(path[len("/openai"):])
        return None
