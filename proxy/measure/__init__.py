"""Measurement: one per-request timing record stamped on the hot path (timing.py, context.py), split into phases
and judged against its objective when the request finishes (slo.py), then exported once, from that record, to
Prometheus (metrics.py, series.py, labels.py, buckets.py), OpenTelemetry (tracing.py, export.py, meters.py) and the
records (telemetry.py's sinks). Work that must not run on the event loop goes to offload.py's worker and threads.
It knows nothing of the fleet: what a replica learns from a finished request reaches it through `context.Lesson`.
"""
