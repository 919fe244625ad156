"""The label-set budget of the per-request metrics: how many distinct models and (model, upstream,
endpoint, stream, tenant) sets one scrape may carry, whatever names clients send."""
from __future__ import annotations


def served(status_code: int) -> bool:
    """Whether a request's model name may take a place among the kept names: anything but a client error (a 4xx other
    than 429: an engine's 404 for a model it does not have, the proxy's own for one it does not route). A client
    sending junk names gets refusals, and its names take none of the places real models need."""
    return not 400 <= status_code < 500 or status_code == 429


class ModelLabels:
    """Caps the distinct `model` label values; later ones become `other`. The names the configuration knows (`know`:
    the routes' and objectives' exact names) are always kept and count against no cap; the others take a place in the
    order they come, and only when the upstream did not refuse them (`served`). And caps the label sets
    (model, upstream, endpoint, stream, tenant) the per-request metrics get, whatever mix of APIs,
    models and tenants made them: past `max_sets`, a new set's model is `other` (its counts and
    latencies still go somewhere visible), keeping its tenant while a reserve of `max_sets // 16`
    such sets lasts, then `other` too; so one scrape stays under its series budget with every API
    and every tenant in use. A tenant's sets are forgotten when its series expire (`forget`)."""

    def __init__(self, limit: int, max_sets: int = 400) -> None:
        self.limit, self.max_sets = limit, max_sets
        self.known: frozenset[str] = frozenset()
        self._seen: set[str] = set()
        self._sets: set[tuple[str, ...]] = set()
        self._folded: set[tuple[str, ...]] = set()  # model `other`, tenant kept: the reserve

    def __call__(self, model: str, admit: bool = True) -> str:
        """The label of `model`; `admit`: it may take a place (its request was `served`)."""
        if model in self._seen or model in self.known:
            return model
        if len(self._seen) >= self.limit or not admit:
            return "other"
        self._seen.add(model)
        return model

    def know(self, names: tuple[str, ...]) -> None:
        """The names the configuration knows now (at start and at each reload)."""
        self.known = frozenset(names)

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
