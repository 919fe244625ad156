"""Each replica's predicted time to first token (proxy/forecast.py): the fit, the choice, the exploration."""
import random

from proxy.forecast import MIN_SAMPLES, REFERENCE_TOKENS, STALE_S, Forecast, choose, predictions


def trained(seconds_per_token: float, fixed: float, n: int = 60) -> Forecast:
    f = Forecast()
    rng = random.Random(1)
    for _ in range(n):
        x = rng.choice((100, 500, 2000, 8000)) + rng.randrange(0, 3000)  # its prompt and the work pending before it
        f.add(x, fixed + seconds_per_token * x)
    f.last_s = 1000.0
    return f


def test_the_fit_recovers_the_prefill_rate_and_fixed_cost():
    f = trained(1 / 4000, 0.02)
    a, b = f.coefficients()
    assert abs(a - 0.02) < 1e-6 and abs(1 / b - 4000) < 1e-3
    f.pending = 4000  # a second of work ahead of the next request
    assert abs(f.predict(1000) - (0.02 + 5000 / 4000)) < 1e-6
    assert Forecast().predict(1000) is None  # nothing measured yet


def test_the_lowest_prediction_wins_and_pending_work_counts():
    fast, slow = trained(1 / 20000, 0.01), trained(1 / 4000, 0.01)  # the second prefills five times slower
    rng = random.Random(0)
    pick = lambda prompt: choose([("fast", fast), ("slow", slow)], prompt, rng, now=1001.0)  # noqa: E731
    assert pick(8000) == 0
    fast.pending = 200_000  # ten seconds of prompts already waiting on the fast one
    assert pick(8000) == 1
    assert predictions([("fast", fast), ("slow", slow)]).keys() == {"fast", "slow"}


def test_a_new_or_forgotten_replica_is_probed_with_short_requests_only():
    known, new = trained(1 / 20000, 0.01), Forecast()
    rng = random.Random(0)
    assert choose([("known", known), ("new", new)], REFERENCE_TOKENS, rng, now=1001.0) == 1  # short: probe it
    assert choose([("known", known), ("new", new)], 8 * REFERENCE_TOKENS, rng, now=1001.0) == 0  # long: the known one
    for _ in range(MIN_SAMPLES):
        new.add(100, 0.01)
    new.last_s = 1000.0
    assert choose([("known", known), ("new", new)], 100, rng, now=1000.0 + STALE_S + 1) == 0  # (both stale: the first)
    assert choose([("a", Forecast()), ("b", Forecast())], 8 * REFERENCE_TOKENS, rng) is None  # nothing known: the caller's fallback


def test_short_prompts_alone_still_say_how_slow_a_long_one_would_be():
    """A replica only ever sent short prompts: its measured rate, not a flat line, predicts a long one."""
    slow = Forecast()
    for x in (200, 210, 190, 205, 195, 200):
        slow.add(x, x / 4000)  # 4,000 tokens/s
    assert abs(slow.predict(6000) - 6000 / 4000) < 1e-9
