"""llm-latency-proxy: an OpenAI-compatible proxy that measures where each request's time goes."""

__version__ = "0.1.0"
