"""The short soak (18 s, sampled every 1.5 s) that `make test` runs; `make soak` runs the 30-minute one."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.scale.soak import soak  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_short_soak_loses_nothing():
    report = soak(duration_s=18, concurrency=40, fault_share=0.05, sample_every=1.5)
    assert report.sent > 100
    assert report.transport_failures == 0 and report.unexpected == 0
    assert report.success_rate == 1.0
    assert report.counted_by_proxy == report.sent  # every request counted exactly once
    # Sockets and descriptors are bounded by the load (a client and a pooled upstream connection
    # per stream) and do not creep up over the run.
    sockets, fds = [s["sockets"] for s in report.samples], [s["fds"] for s in report.samples]
    half = len(sockets) // 2
    assert max(sockets) <= 2 * 40 + 10
    assert max(fds[half:]) <= max(fds[:half]) + 5
    assert report.rss_growth() < 0.10
