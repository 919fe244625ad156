"""`python -m bench.relay`: What the relay costs beside Envoy and beside a direct connection: CPU per chunk and per request, added latency, the layers and steps that cost it, and A/B between two checkouts.

Subcommands: compare, overhead, chunk-cpu, hop, floor, layers, accept, asgi-servers, clients, finish, tracing-cost, steps, profile, agent.
"""
