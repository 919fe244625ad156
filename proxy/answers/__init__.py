"""The answers over the records: `explain` (explain.py), its attainment, error budget and capacity (budget.py), its
per-tenant ledger (ledger.py) and the burn-rate alert rules made from the objectives (rules.py). They read the
records store (records/) and the objectives (measure/slo.py); nothing on the request path imports them.
"""
