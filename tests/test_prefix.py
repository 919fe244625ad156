"""Each replica's prefix index (proxy/prefix.py): prompts as chains of links, the longest held prefix, the LRU
bounded in tokens, what the engine's report corrects, and the session key."""
from __future__ import annotations

from proxy.prefix import Index, chain

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 400}  # ~2,400 tokens estimated
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}} for i in range(20)]


def turns(session: str, n: int, tools: bool = True) -> list[dict]:
    """The requests of one agent session: each the last one's messages plus a turn."""
    messages = [SYSTEM, {"role": "user", "content": f"task of {session}: " + "fix the bug " * 200}]
    out = []
    for turn in range(n):
        out.append({"model": "m", "messages": list(messages), **({"tools": TOOLS} if tools else {})})
        messages += [{"role": "assistant", "content": f"{session} step {turn} " + "reading files " * 100},
                     {"role": "user", "content": f"tool result {turn} " + "x = 1\n" * 300}]
    return out


def test_a_growing_conversation_matches_all_but_its_new_turn():
    index = Index()
    requests = [chain(r) for r in turns("a", 4)]
    assert index.match(requests[0]) == 0
    for before, after in zip(requests, requests[1:]):
        index.sent(before)
        assert index.match(after) == before.total  # everything the last turn sent, nothing of the new one
        assert 0 < after.total - index.match(after) < 1000
    assert len({r.session for r in requests}) == 1 and requests[0].session != chain(turns("b", 1)[0]).session


def test_the_system_prompt_and_tools_are_shared_across_sessions_but_not_the_rest():
    index = Index()
    index.sent(chain(turns("a", 1)[0]))
    other = chain(turns("b", 1)[0])
    assert index.match(other) == other.tokens[0] + other.tokens[1]  # the head (the tools) and the system message; not its task
    assert chain({"messages": [SYSTEM, {"role": "user", "content": "hi"}]}).tokens[0] == other.tokens[1]  # (no tools: no head)


def test_keys_an_engine_does_not_render_do_not_break_the_chain():
    first = turns("a", 2, tools=False)
    marked = [dict(m) for m in first[1]["messages"]]
    marked[-1] = {**marked[-1], "cache_control": {"type": "ephemeral"}}  # (Anthropic's: on the newest message, every turn)
    index = Index()
    index.sent(chain(first[0]))
    assert index.match(chain({**first[1], "messages": marked})) == chain(first[0]).total


def test_the_index_is_an_lru_bounded_in_tokens_and_reports_shrink_it():
    requests = [chain(turns(s, 1)[0]) for s in "abcdef"]
    shared = requests[0].tokens[0] + requests[0].tokens[1]  # (the tools and the system message: every session's)
    index = Index(capacity=shared + 3 * requests[0].tokens[2], floor=1000)
    for r in requests[:3]:
        index.sent(r)
    assert all(index.match(r) == r.total for r in requests[:3])
    index.sent(requests[3])  # past capacity: the least recently sent links go (a's own, not the shared head: sent again)
    assert index.match(requests[0]) < requests[0].total and index.match(requests[3]) == requests[3].total
    held = index.held
    index.reported(predicted=requests[3].total, cached=requests[3].total // 2)  # the engine had half of what was predicted
    assert index.capacity == held - (requests[3].total - requests[3].total // 2) and index.held <= index.capacity
    capacity = index.capacity
    index.reported(predicted=1000, cached=1000)  # as predicted: it may hold a little more again
    assert index.capacity > capacity


def test_nothing_to_chain():
    assert chain(None) is None and chain({"model": "m"}) is None and chain({"messages": [], "_partial": True}) is None
    completion = chain({"model": "m", "prompt": "once upon a time " * 50})
    assert completion is not None and len(completion.hashes) == 1


def test_what_is_forgotten_shortens_a_chain_and_never_cuts_its_head():
    """Past capacity the oldest prompt's end goes first: its head (shared, sent again and again) stays matched."""
    requests = [chain(turns(s, 3)[2]) for s in "abc"]
    shared = requests[0].tokens[0] + requests[0].tokens[1]  # (the tools and the system message: held once)
    own = [r.total - shared for r in requests]
    index = Index(capacity=shared + own[0] // 2 + own[1] + own[2], floor=1000)
    for r in requests:
        index.sent(r)
    first = requests[0]
    assert 0 < index.match(first) < first.total  # a's tail forgotten, its beginning still held
    assert index.match(first) >= first.tokens[0] + first.tokens[1]


def test_the_simulated_engine_caches_blocks_of_the_rendered_prompt():
    """simulator/cache.py: a prompt seen before is cached but for its last token; a longer one by what it shares;
    a different one not at all; past capacity the least recently used go."""
    from proxy.simulator.cache import PrefixCache

    cache = PrefixCache(capacity_tokens=10_000)
    base = ["system " * 1000, "task " * 500]
    assert cache.serve(base, 2000) == 0
    assert 1950 <= cache.serve(base, 2000) < 2000  # (whole blocks only, never the last token)
    grown, shared = cache.serve([*base, "tool output " * 400], 2800), len("\x1e".join(base)) / len("\x1e".join([*base, "tool output " * 400]))
    assert 0.98 * shared * 2800 <= grown <= shared * 2800  # (the share of the rendered text it shares)
    assert cache.serve(["other " * 1000], 1000) == 0
    for i in range(20):  # 20 x 1,000 tokens of other prompts: past capacity
        cache.serve([f"prompt {i} " * 1000], 1000)
    assert cache.serve(base, 2000) == 0 and cache.held <= 10_000
