"""`python -m bench.scale`: The proxy at scale: the scrape's size and time, thousands of streams, workers, a long soak.

Subcommands: scrape, streams-scale, workers, soak.
"""
