"""`python -m bench.truth`: Whether the numbers are true: stamps against an injected schedule, real streams' shapes, bursts seen from both sides, slow clients, hostile bodies, pauses and big bodies that could move another stream's figures.

Subcommands: stamps, shapes, burst, burst-phases, slow-clients, hostile, gc-pauses, bigbody, apis, framing.
"""
