"""`python -m bench.fleet`: The fleet's decisions under load: placement by predicted TTFT and by prefix cache, sick replicas, a full fleet, fair shares between tenants, overload.

Subcommands: pick, prefix-affinity, sick-fleet, full-fleet, fairness, overload.
"""
