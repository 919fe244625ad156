"""Each replica's predicted time to first token (proxy/fleet/forecast.py): the fit, the gauge, the deadline it gives."""
import random

from proxy.fleet.forecast import DEADLINE_MARGIN, MIN_SAMPLES, PRIOR_TOKENS_PER_S, Forecast, predictions


def trained(seconds_per_token: float, fixed: float, n: int = 60) -> Forecast:
    f = Forecast()
    rng = random.Random(1)
    for _ in range(n):
        x = rng.choice((100, 500, 2000, 8000)) + rng.randrange(0, 3000)  # its prompt and the work pending before it
        f.add(x, fixed + seconds_per_token * x)
    f.last_s, f.sent = 1000.0, n
    return f


def test_the_fit_recovers_the_prefill_rate_and_fixed_cost():
    f = trained(1 / 4000, 0.02)
    a, b = f.coefficients()
    assert abs(a - 0.02) < 1e-6 and abs(1 / b - 4000) < 1e-3
    f.pending = 4000  # a second of work ahead of the next request
    assert abs(f.predict(1000) - (0.02 + 5000 / 4000)) < 1e-6
    assert Forecast().predict(1000) is None  # nothing measured yet
    few = Forecast()
    for _ in range(MIN_SAMPLES - 1):
        few.add(100, 0.1)
    assert few.predict(100) is None  # (fewer than MIN_SAMPLES answers: no fit)
    assert predictions([("known", f), ("new", Forecast())]).keys() == {"known"}


def test_short_prompts_alone_still_say_how_slow_a_long_one_would_be():
    """A replica only ever sent short prompts: its measured rate, not a flat line, predicts a long one."""
    slow = Forecast()
    for x in (200, 210, 190, 205, 195, 200):
        slow.add(x, x / 4000)  # 4,000 tokens/s
    assert abs(slow.predict(6000) - 6000 / 4000) < 1e-9


def test_a_deadline_is_never_shorter_than_what_the_prompt_is_expected_to_take():
    """The route's deadline for a short prompt; for a long one, a margin over its expected TTFT: measured
    when the replica has a fit, else at the prior rate (a replica never measured is not abandoned for it)."""
    known = trained(1 / 5000, 0.02)  # 5,000 prompt tokens a second
    assert known.deadline_s(1.0, 100) == 1.0
    assert abs(known.deadline_s(1.0, 8000) - DEADLINE_MARGIN * (0.02 + 8000 / 5000)) < 1e-9  # 1.6 s expected: 2.43 s, not 1.0
    assert Forecast().deadline_s(1.0, 100) == 1.0
    assert Forecast().deadline_s(1.0, 10_000) == DEADLINE_MARGIN * 10_000 / PRIOR_TOKENS_PER_S
    # Work ahead of it counts (forecast_x is the pending prompt tokens plus its own): expected queueing is no failure.
    assert known.deadline_s(1.0, 100 + 20_000) > DEADLINE_MARGIN * 4.0


def test_an_inline_image_is_an_images_tokens_not_its_bytes():
    """A screenshot sent inline, in each API's shape (a data URI, Anthropic's base64 source, also inside a tool's
    result, Gemini's inlineData, the Responses API's input_image, Ollama's images): MEDIA_TOKENS each, never its
    megabyte / 4; text around it counted as before."""
    import base64
    import os

    import orjson

    from proxy.wire import prompt as prefix
    from proxy.wire.prompt import MEDIA_TOKENS, media, tokens

    image = base64.b64encode(os.urandom(600_000)).decode()
    uri = "data:image/png;base64," + image
    shapes = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": uri}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                      "content": [{"type": "image", "source": {"type": "base64", "data": image}}]}]}]},
        {"contents": [{"role": "user", "parts": [{"text": "hi"}, {"inlineData": {"mimeType": "image/png", "data": image}}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": uri}]}]},
        {"model": "llava", "messages": [{"role": "user", "content": "what is this", "images": [image, image]}]},
    ]
    for body in shapes:
        size = len(orjson.dumps(body))
        found = media(prefix.sequence(body))
        pieces = 2 if "images" in str(body)[:200] else 1
        assert found[1] == pieces and found[0] >= pieces * len(image), (found, str(body)[:80])
        assert pieces * MEDIA_TOKENS <= tokens(size, found) < pieces * MEDIA_TOKENS + 100, tokens(size, found)
        made = prefix.chain(body, tokens(size, found))
        assert made is not None and made.total < pieces * MEDIA_TOKENS + 100  # (the index's capacity: an image's estimate too)
    assert media(prefix.sequence({"messages": [{"role": "user", "content": "data:image/png;base64," + image}]})) == (0, 0)  # text is text
