"""A route's retry budget (proxy/fleet/retry.py): a share of its recent requests, with a floor, over a window."""
import pytest

from proxy.fleet.retry import BudgetSpec, RetryBudget


def test_retries_are_bounded_by_the_floor_and_the_share_of_requests():
    budget = RetryBudget(BudgetSpec(ratio=0.1, min_per_s=0.5, window_s=10))
    now = 1000.0
    for _ in range(100):
        budget.request(now)
    allowed = sum(budget.allow(now) for _ in range(50))
    assert allowed == 15  # 0.5/s x 10 s + 10% of 100 requests
    assert not budget.allow(now + 5)  # still within the window
    assert budget.allow(now + 10.5)  # the window moved on: its requests and retries are gone, the floor is back
    assert sum(budget.allow(now + 10.5) for _ in range(10)) == 4  # (5 of the floor, one used just above)


def test_a_quiet_route_can_still_fail_over():
    budget = RetryBudget()  # 3 a second over 10 s by default
    budget.request(0.0)
    assert budget.allow(0.0)


@pytest.mark.parametrize("spec, words", [({"ratio": -1}, "non-negative"), ({"window": 0}, "non-negative"), ({"burst": 2}, "retry_budget must be"),
                                         ("lots", "retry_budget must be")])
def test_a_broken_budget_is_refused(spec, words):
    with pytest.raises(ValueError) as error:
        BudgetSpec.parse(spec, "routes file r.yaml, line 7")
    assert "line 7" in str(error.value) and words in str(error.value)
