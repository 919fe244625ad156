"""What each replica has cached of the prompts sent to it: a prefix index per replica (estimation mode,
as the Gateway API Inference Extension's prefix-cache scorer), checked against what the engine reports.

An engine with prefix caching (vLLM's automatic prefix caching, SGLang's radix cache, llama.cpp's
slot cache) prefills only what it has not seen. A coding agent resends its whole, growing conversation
every turn, so each turn is the last one's prompt plus what the turn added. The proxy keeps, per
replica, the prompts it sent there as their chains of links (wire/prompt.py: each link's hash stands for
the whole prompt up to it, with its size in estimated tokens). A request's cached part on a replica is its
longest chain of links the replica's index holds (`match`). The index is an LRU bounded in tokens and
in links (`Index`: its memory, whatever the prompts' shapes); it is
updated when the replica answered a request (`sent`, told by placement.py at its first token or its
answer: a prompt a replica failed is not cached there), and corrected by what the response reports
(`prompt_tokens_details.cached_tokens`, `cache_read_input_tokens`, llama.cpp's `cache_n`, Gemini's
`cachedContentTokenCount`): a replica that reports fewer cached tokens than predicted has evicted what
the index still holds, so the index holds that much less from then on, its oldest links forgotten
(`reported`); its capacity grows back while its predictions hold.

`session`: the hash of the chain up to the conversation's first non-system message, the same for every
turn of one conversation and different across conversations: proxies that share nothing agree on a
session's replica by rendezvous hashing on it (picker.py). `opening`: the tokens of its first turn's
prompt (before its first answer), which every later turn begins with, so any replica that served the
conversation holds it: a replica reporting none of it for a conversation this index did not know there
never had it (`Use.reported`: a stray, and that replica remembered away for the conversation). What comes before
it (`shared`: the system prompt and the tools) is every session's of one agent: once any replica holds
it the placement takes every replica to (each serves some session), so that a proxy that happened to send
it to one replica first does not pull every conversation there.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from ..wire.prompt import Chain

CAPACITY_TOKENS = 1_000_000  # what an index holds per replica at most (an engine with a large KV cache; the reports correct it)
MIN_CAPACITY = 10_000
TOLERANCE = 256  # tokens: an engine caches whole blocks, the estimate is bytes / 4
AWAY_MAX = 10_000  # conversations remembered as not on a replica, per replica
LINKS_MAX = 32_768  # links an index holds at most, whatever their tokens (about 5 MB a replica: docs/deployment.md)


class Index:
    """One replica's links, least recently sent first, bounded in tokens and in links (`LINKS_MAX`: its memory, whatever
    the prompts' shapes). On the event loop only."""

    __slots__ = ("capacity", "ceiling", "floor", "links", "held", "away")

    def __init__(self, capacity: int = CAPACITY_TOKENS, floor: int = MIN_CAPACITY) -> None:
        self.capacity = self.ceiling = capacity
        self.floor = floor  # (what a report shrinks it to at least)
        self.links: collections.OrderedDict[int, int] = collections.OrderedDict()  # hash -> its tokens
        self.held = 0
        self.away: collections.OrderedDict[int, None] = collections.OrderedDict()  # conversations found not here (`Use.reported`)

    def match(self, prompt: Chain) -> int:
        """Tokens of the longest prefix of the prompt this replica holds."""
        matched, links = 0, self.links
        for link, size in zip(prompt.hashes, prompt.tokens):
            if link not in links:
                break
            matched += size
        return matched

    def sent(self, prompt: Chain) -> None:
        """The prompt went to this replica: it holds all of it now. Past capacity the least recently sent goes, a
        prompt's end before its beginning (its links renewed from the last to the first): as an engine evicts, so
        that what is forgotten shortens a chain and never cuts its head off."""
        links = self.links
        for link, size in zip(reversed(prompt.hashes), reversed(prompt.tokens)):
            if link in links:
                links.move_to_end(link)
            else:
                links[link] = size
                self.held += size
        self.away.pop(prompt.session, None)
        self._trim()

    def lost(self, prompt: Chain) -> None:
        """The prompt's conversation was not here before this prompt came: its links forgotten (this copy is not where
        the conversation lives), and the conversation remembered as away from this replica."""
        links = self.links
        for link in prompt.hashes[prompt.start:]:
            size = links.pop(link, None)
            if size is not None:
                self.held -= size
        self.away[prompt.session] = None
        self.away.move_to_end(prompt.session)
        if len(self.away) > AWAY_MAX:
            self.away.popitem(last=False)

    def clear(self) -> None:
        """The engine restarted (it failed its checks, then passed): its cache is empty, whatever this index held."""
        self.links.clear()
        self.held, self.capacity = 0, self.ceiling

    def forget(self, prompt: Chain) -> None:
        """The prompt is likely evicted here (a predicted hit missed its deadline): its links past what every session
        shares forgotten, the conversation not marked away (it may live here still, re-prefilled)."""
        links, seen = self.links, 0
        for link, size in zip(prompt.hashes, prompt.tokens):
            seen += size
            if seen > prompt.shared and (held := links.pop(link, None)) is not None:
                self.held -= held

    def reported(self, predicted: int, cached: int) -> None:
        """The engine reported `cached` tokens of a prompt this index predicted `predicted` of (both estimated). Fewer:
        it evicted links this index still holds, the least recently sent ones if it is an LRU as this is, so this
        index holds about that much less from now on (its oldest links forgotten). As predicted: it may hold a
        little more again (an eviction storm passes)."""
        if cached + TOLERANCE < predicted:
            self.capacity = max(self.floor, self.held - (predicted - cached))
            self._trim()
        elif self.capacity < self.ceiling:
            self.capacity = min(self.ceiling, int(self.capacity * 1.02) + TOLERANCE)

    def _trim(self) -> None:
        links = self.links
        while (self.held > self.capacity or len(links) > LINKS_MAX) and links:
            self.held -= links.popitem(last=False)[1]


@dataclass(slots=True)
class Use:
    """A request's prompt on the replica it was sent to: what the index predicted cached, for the check at its end."""

    index: Index
    prompt: Chain
    predicted: int  # estimated tokens predicted cached there
    rivals: tuple[Index, ...] = ()  # a conversation this index did not know there: where else it may live (picker.py)

    def reported(self, cached: int) -> bool:
        """The engine reported `cached` (estimated) tokens of the prompt cached: the index corrected by it, and a
        conversation past its first turn that this index did not know there checked. Holding its first turn's prompt
        (half of its own part at least): it lives there (another proxy sent it, or this one before a restart), and the
        index holds it since the send. Less: a stray (True), prefilled whole. While a rival replica may hold it, it
        lives there, and this copy is not where the next turn should follow (`Index.lost`); with every rival looked
        at, it lived nowhere a proxy places it (a conversation resumed, its cache evicted): it lives here now."""
        p = self.prompt
        self.index.reported(self.predicted, cached)
        own = p.opening - p.shared
        if own < TOLERANCE or self.predicted > p.shared or cached >= p.shared + own // 2:
            return False
        if any(p.session not in r.away for r in self.rivals):
            self.index.lost(p)
        return True
