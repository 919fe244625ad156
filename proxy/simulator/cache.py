"""The simulated engine's prefix cache (`--prefix-cache-tokens N`): what vLLM's automatic prefix caching
does, so tests and `make demo` see cached tokens as an engine reports them.

Deliberately not the proxy's own model of a cache (proxy/fleet/prefix.py chains whole messages of the
request's JSON): the engine sees the prompt as rendered, so this one chains fixed blocks of the
prompt's text (`BLOCK_CHARS`, about 16 tokens, as vLLM's 16-token blocks), each block's hash the hash
of all the text before it too. A prompt's cached part is its longest run of leading blocks the cache
holds; the last token is always computed (an engine needs its logits). Blocks are evicted least
recently used, the end of a prompt before its beginning (a chain is cut from its tail, as vLLM's free
queue orders a request's blocks), past `capacity` tokens.
"""
from __future__ import annotations

import collections
import hashlib

BLOCK_CHARS = 64


class PrefixCache:
    """One replica's cache of prompt blocks, bounded in tokens."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.blocks: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # block hash -> its tokens
        self.held = 0.0

    def serve(self, texts: list[str], prompt_tokens: int) -> int:
        """The prompt's tokens found cached; the prompt's blocks are cached now (the most recently used)."""
        text = "\x1e".join(texts).encode()
        n = len(text) // BLOCK_CHARS
        if not n or prompt_tokens <= 1:
            return 0
        per_block = prompt_tokens * BLOCK_CHARS / len(text)
        digest = hashlib.blake2b(digest_size=16)
        hashes = []
        for i in range(n):
            digest.update(text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS])
            hashes.append(digest.copy().digest())
        blocks = self.blocks
        matched = 0
        while matched < n and hashes[matched] in blocks:
            matched += 1
        for h in reversed(hashes):  # the prompt's first block the most recently used: the tail goes first
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = per_block
                self.held += per_block
        while self.held > self.capacity and blocks:
            self.held -= blocks.popitem(last=False)[1]
        return min(prompt_tokens - 1, round(matched * per_block))

    def clear(self) -> None:
        self.blocks.clear()
        self.held = 0.0
