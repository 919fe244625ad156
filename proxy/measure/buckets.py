"""Histogram bucket bounds, defined once: what the Prometheus histograms expose (metrics.py), and
what the records' hourly aggregates count TTFT and end to end in (records/columns.py), so that a
summary read from the store and a quantile read from Prometheus fall in the same buckets.

The sets come from what the dashboard and the alert rules read (each alert threshold is a bucket
bound, so the rule compares exact counts) and from the shapes LLM traffic takes. A histogram costs
(buckets + 3) series per label set; at the model cap (--max-models 100, chat and completions,
streaming and not) the whole exposition stays under 20,000 series
(tests/test_metrics.py::test_series_at_the_model_cap). What needs only a mean per model (seconds
per phase, chunk gaps, tokenizer and engine-reported times) is a counter or a summary (sum and
count), not buckets. Prometheus native histograms would cost one series each, but
prometheus_client cannot expose them yet (client_python PR #1104, open): revisit then.
"""
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)  # a whole generation
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # alert: p95 > 5 s
GAP_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)  # 1000 to 1 tok/s per stream
TPS_BUCKETS = (5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 300.0, 1000.0)  # alert: p50 < 20 tok/s
PREFILL_TPS_BUCKETS = (100.0, 300.0, 1000.0, 3000.0, 10000.0, 30000.0, 100000.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)  # alert: p99 > 10 ms
LAG_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # how late the event loop ran a timer (cpu.py)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # a wait for a slot: --admission-queue-s
RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
