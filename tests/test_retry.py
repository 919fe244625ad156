"""A route's retry budget (proxy/fleet/retry.py): retries in flight, a share of the route's requests in flight, with a
floor (Envoy's retry budget)."""
import pytest

from proxy.fleet.retry import BudgetSpec, RetryBudget


def test_retries_in_flight_are_bounded_by_the_floor_and_the_share_of_requests_in_flight():
    budget = RetryBudget(BudgetSpec(ratio=0.2, min_concurrency=3))
    for _ in range(10):
        budget.started()
    assert sum(budget.allow() for _ in range(10)) == 5  # 20% of 10, and 3
    for _ in range(35):
        budget.started()
    assert sum(budget.allow() for _ in range(10)) == 7  # 20% of 45, and 3: 12 in flight at once
    budget.ended(retried=True)  # a retried request ends: its retry leaves the budget
    budget.started()
    assert budget.could_allow() and budget.allow() and not budget.allow()
    for _ in range(10):
        budget.ended(retried=True)
    assert budget.requests == 35 and budget.retries == 2


def test_a_quiet_route_can_still_fail_over_and_the_bound_grows_with_the_load():
    budget = RetryBudget()  # Envoy's defaults: 20%, at least 3
    budget.started()
    assert budget.allow()
    for _ in range(999):
        budget.started()
    assert sum(budget.allow() for _ in range(300)) == 202  # 20% of 1,000 in flight and 3, one already spent


@pytest.mark.parametrize("spec, words", [({"ratio": -1}, "a share in [0, 1]"), ({"min_concurrency": 1.5}, "whole number"),
                                         ({"min_per_second": 3}, "retry_budget must be"), ("lots", "retry_budget must be")])
def test_a_broken_budget_is_refused(spec, words):
    with pytest.raises(ValueError) as error:
        BudgetSpec.parse(spec, "routes file r.yaml, line 7")
    assert "line 7" in str(error.value) and words in str(error.value)
