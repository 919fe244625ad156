"""Each replica's prefix index (proxy/fleet/prefix.py): prompts as chains of links, the longest held prefix, the LRU
bounded in tokens, what the engine's report corrects, and the session key."""
from __future__ import annotations

from proxy.fleet.prefix import Index, Use
from proxy.wire.prompt import Chain, chain

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


def test_a_missed_hit_forgets_the_prompt_past_the_shared_head_and_a_restart_forgets_everything():
    requests = [chain(turns(s, 1)[0]) for s in "ab"]
    shared = requests[0].shared
    index = Index()
    for r in requests:
        index.sent(r)
    index.forget(requests[0])  # (a predicted hit missed its deadline: likely evicted)
    assert shared and index.match(requests[0]) == shared and index.match(requests[1]) == requests[1].total
    assert requests[0].session not in index.away  # (not marked away: it may live here still)
    index.clear()  # (the engine restarted)
    assert index.match(requests[1]) == 0 and index.held == 0 and index.capacity == index.ceiling


def test_a_conversation_knows_its_first_turn():
    """`opening`: the tokens of the first turn's prompt (before the first answer), which every later turn begins with;
    the answers of Gemini (`model`) and of the Responses API (its output items resent as input) count."""
    requests = [chain(r) for r in turns("a", 3)]
    assert requests[0].opening == 0 and requests[1].opening == requests[2].opening == requests[0].total
    assert requests[0].hashes[requests[0].start] == requests[0].session and requests[0].shared == sum(requests[0].tokens[:requests[0].start])
    gemini = chain({"contents": [{"role": "user", "parts": [{"text": "task " * 300}]}, {"role": "model", "parts": [{"text": "ok"}]},
                                 {"role": "user", "parts": [{"text": "more"}]}]})
    responses = chain({"instructions": "be brief", "input": [{"role": "user", "content": "task " * 300},
                                                             {"type": "function_call", "name": "ls", "arguments": "{}", "call_id": "c"},
                                                             {"type": "function_call_output", "call_id": "c", "output": "a b"}]})
    assert gemini is not None and gemini.opening == gemini.tokens[0]
    assert responses is not None and responses.opening == responses.tokens[0] + responses.tokens[1]


def holds(index: Index, prompt: Chain) -> bool:
    """Whether the index holds the prompt's conversation (more of it than the agent's shared head)."""
    return index.match(prompt) > prompt.shared


def test_a_replica_that_never_had_a_conversation_is_remembered_away():
    """A conversation past its first turn that this index did not know on the replica it was sent to: if the engine
    reports nothing of its first turn cached, it is a stray; while a rival replica may hold it, its links are forgotten
    there and the replica remembered away for it. If it reports the first turn, the conversation lives there (another
    proxy sent it): held. With every rival away, it lived nowhere: it lives here now. A conversation the index knew
    that comes back shorter is an eviction, not a stray."""
    requests = [chain(r) for r in turns("a", 3)]
    shared, start = requests[0].shared, requests[0].start
    elsewhere, home, known, last = Index(), Index(), Index(), Index()
    elsewhere.sent(Chain(requests[0].hashes[:start], requests[0].tokens[:start], 0))  # (the agent's head only: another session's)
    strays = []
    for index, cached in ((elsewhere, shared), (home, requests[0].total)):
        use = Use(index, requests[1], index.match(requests[1]), rivals=(home if index is elsewhere else elsewhere,))
        assert use.predicted <= shared
        index.sent(requests[1])
        strays.append(use.reported(cached))
    assert strays == [True, False]
    assert not holds(elsewhere, requests[2]) and requests[2].session in elsewhere.away
    assert elsewhere.match(requests[2]) == shared  # (the agent's head kept: it is there)
    assert holds(home, requests[2]) and requests[2].session not in home.away and home.match(requests[2]) == requests[1].total
    use = Use(last, requests[2], last.match(requests[2]), rivals=(elsewhere,))  # (its one rival already looked at)
    last.sent(requests[2])
    assert use.reported(0) and holds(last, requests[2]) and requests[2].session not in last.away  # (lived nowhere: here now)
    known.sent(requests[1])
    use = Use(known, requests[2], known.match(requests[2]), rivals=(elsewhere,))
    known.sent(requests[2])
    assert not use.reported(shared)  # (evicted: the capacity shrinks, the conversation is not a stray)
    assert requests[2].session not in known.away and known.capacity < known.ceiling
    elsewhere.sent(requests[2])  # sent there after all (its home set aside): held again
    assert holds(elsewhere, requests[2]) and requests[2].session not in elsewhere.away


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


def test_a_long_message_is_told_apart_by_every_character_and_key():
    """A long plain message is hashed from its strings, not its JSON (an agent's system prompt: 113 µs of escaping
    saved): still every character, every key and where one string ends counts, and the same message hashes the same."""
    text = "line of the system prompt\n" * 400

    def first(message: dict) -> int:
        return chain({"messages": [message, {"role": "user", "content": "hi"}]}).hashes[0]

    variants = [{"role": "system", "content": text},
                {"role": "system", "content": text[:5000] + "L" + text[5001:]},  # one character in the middle
                {"role": "system", "content": text, "name": "agent"},  # one key more
                {"role": "sys", "content": "tem" + text},  # the same bytes, another split between the strings
                {"role": "system", "content": [{"type": "text", "text": text}]}]  # the same text as parts (its JSON)
    assert len({first(m) for m in variants}) == len(variants)
    assert first({"role": "system", "content": text}) == first(dict(variants[0]))
    assert len(text) // 4 <= chain({"messages": [variants[0]]}).tokens[0] < (len(text) + 64) // 4  # its size: the text, not its escapes
    # The head (instructions, a system prompt, the tools) holding a long text: the same rules.
    def head(request: dict) -> int:
        return chain({**request, "input": [{"role": "user", "content": "hi"}]}).hashes[0]

    heads = [{"instructions": text}, {"instructions": text[:-1] + "L"}, {"instructions": text, "tools": [{"name": "t"}]},
             {"instructions": text, "tools": [{"name": "u"}]}, {"system": text}, {"instructions": text + "x" * 10}]
    assert len({head(h) for h in heads}) == len(heads) - 1  # (instructions and system are the same head: both the system prompt)
    assert head({"instructions": text, "tools": [{"name": "t"}]}) == head(heads[2])
    # An engine does not render cache_control, whatever its value: a long message with one hashes as without.
    assert first({"role": "system", "content": text, "cache_control": "ephemeral"}) == first(variants[0])


def test_a_hostile_body_costs_a_few_links_whatever_it_holds():
    """Bodies an engine rejects or truncates cheaply, each legal JSON: a completions prompt of 450,000 token ids, a
    chat of 60,000 empty messages, a batch of 200,000 one-token prompts. Each is a few hundred links at most, every
    link has a size, the whole prompt is still counted (its unlinked rest), and an index holds at most LINKS_MAX links
    however many such prompts it is sent (its memory: a link is an int key and an int in an ordered dict)."""
    import orjson

    from proxy.fleet import prefix
    from proxy.wire import prompt
    from proxy.wire.prompt import tokens

    bodies = [{"model": "m", "prompt": [7] * 450_000}, {"model": "m", "messages": [{"role": "user", "content": ""}] * 60_000},
              {"model": "m", "prompt": [[3]] * 200_000}]
    index = Index()
    for body in bodies:
        size = tokens(len(orjson.dumps(body)))
        made = chain(body, size)
        assert made is not None and len(made.hashes) <= prompt.ITEMS_LINKED * 32 // prompt.LINK_BYTES + 2, len(made.hashes)
        assert min(made.tokens) >= 1 and made.total == max(size, sum(made.tokens)) and made.rest > 0
        index.sent(made)
        assert index.match(made) == sum(made.tokens)  # (what is linked is matched; the rest is only counted)
    for i in range(prefix.LINKS_MAX + 1000):  # tiny prompts, each of its own: past the bound in links long before the one in tokens
        index.sent(chain({"messages": [{"role": "user", "content": f"hi {i}"}]}))
    assert len(index.links) == prefix.LINKS_MAX and index.held < index.capacity


def test_small_messages_share_a_link_and_a_conversation_still_matches():
    """A conversation of short turns ("ok", "go on"): links of at least LINK_BYTES, and each turn still matches all of the
    last one's but its final link's bytes (less than a link: within the engine's block rounding plus TOLERANCE)."""
    from proxy.wire import prompt

    messages = [{"role": "system", "content": "be brief"}]
    index, before = Index(), None
    for turn in range(40):
        messages += [{"role": "user", "content": f"go on {turn}"}, {"role": "assistant", "content": "ok"}]
        now = chain({"messages": list(messages)})
        assert now is not None and len(now.hashes) <= 3 + len(messages) // 4  # (small messages share links)
        if before is not None:
            assert before.total - prompt.LINK_BYTES // 4 - 2 <= index.match(now) <= before.total
        index.sent(now)
        before = now
