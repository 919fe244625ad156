"""The label-set budget of the per-request metrics: how many distinct models and (model, upstream,
endpoint, stream, tenant) sets one scrape may carry, whatever names clients send."""
from __future__ import annotations


class ModelLabels:
    """Caps the distinct `model` label values; later ones become `other`. And caps the label sets
    (model, upstream, endpoint, stream, tenant) the per-request metrics get, whatever mix of APIs,
    models and tenants made them: past `max_sets`, a new set's model is `other` (its counts and
    latencies still go somewhere visible), keeping its tenant while a reserve of `max_sets // 16`
    such sets lasts, then `other` too; so one scrape stays under its series budget with every API
    and every tenant in use. A tenant's sets are forgotten when its series expire (`forget`)."""

    def __init__(self, limit: int, max_sets: int = 400) -> None:
        self.limit, self.max_sets = limit, max_sets
        self._seen: set[str] = set()
        self._sets: set[tuple[str, ...]] = set()
        self._folded: set[tuple[str, ...]] = set()  # model `other`, tenant kept: the reserve

    def __call__(self, model: str) -> str:
        if model in self._seen:
            return model
        if len(self._seen) >= self.limit:
            return "other"
        self._seen.add(model)
        return model

    def label_set(self, model: str, *rest: str) -> tuple[str, ...]:
        """The set to observe (model, *rest); rest's last value is the tenant."""
        key = (model, *rest)
        if key in self._sets or key in self._folded:
            return key
        if model != "other" and len(self._sets) < self.max_sets:
            self._sets.add(key)
            return key
        folded = ("other", *rest)
        if folded in self._folded or rest[-1] == "other" or len(self._folded) < max(1, self.max_sets // 16):
            self._folded.add(folded)
            return folded
        return ("other", *rest[:-1], "other")

    def forget(self, tenants: set[str]) -> None:
        """Their sets no longer count against the budget (their series were removed)."""
        self._sets = {key for key in self._sets if key[-1] not in tenants}
        self._folded = {key for key in self._folded if key[-1] not in tenants}
