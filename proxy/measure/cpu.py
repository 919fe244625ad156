"""The proxy's own CPU, as its streams felt it: the container's throttling and the event loop's lag.

Under a CPU limit (a Kubernetes `resources.limits.cpu`, a LimitRange default), once the processes of a
cgroup spent their quota in a period (100 ms by default) the kernel stops all of them until the next:
the serving process, the records process and the tokenizer worker alike. The cgroup's `cpu.stat` counts
the periods and the time throttled (v1: nr_periods, nr_throttled, throttled_time in ns; v2: nr_periods,
nr_throttled, throttled_usec), read here at each scrape, never sampled: a counter of the kernel's. The
event loop's lag (how late a timer set every `PROBE_S` fired) is what every stream on that loop waited
for it: throttling, a burst, a GC pause, a noisy neighbour. A request's own share of it is its phase
`lag` (timing.py), from the kernel's arrival stamps (arrival.py).
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

IDLE_S = 5.0  # ... and while no request is in flight
PROBE_S = 0.5  # the loop's probe: two timers a second on average, at random, while requests are in flight (a quota's stalls sampled)


@dataclass(frozen=True)
class Cgroup:
    """The cgroup this process runs in: its cpu.stat, and where its quota is (v1 or v2)."""

    stat: Path
    v2: bool

    def read(self) -> dict[str, float]:
        """periods, throttled_periods, throttled_seconds and (with a quota) limit_cores, now."""
        fields = dict(line.split()[:2] for line in self.stat.read_text().splitlines() if len(line.split()) >= 2)
        throttled = int(fields["throttled_usec"]) / 1e6 if self.v2 else int(fields.get("throttled_time", 0)) / 1e9
        out = {"periods": float(fields.get("nr_periods", 0)), "throttled_periods": float(fields.get("nr_throttled", 0)),
               "throttled_seconds": throttled}
        limit = self.limit_cores()
        if limit is not None:
            out["limit_cores"] = limit
        return out

    def limit_cores(self) -> float | None:
        """The quota in cores (quota / period), None without one."""
        folder = self.stat.parent
        try:
            if self.v2:
                quota, period = (folder / "cpu.max").read_text().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            quota_us = int((folder / "cpu.cfs_quota_us").read_text())
            return None if quota_us < 0 else quota_us / int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            return None


def find(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Cgroup | None:
    """This process's CPU cgroup (v2's unified one, else v1's cpu controller), None where there is none (not
    Linux, no cpu controller). In a container's cgroup namespace its path is `/`: the mount's root."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None
    base = Path(root)
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        relative = path.strip().lstrip("/")
        if number == "0" and controllers == "":
            places = [(base / relative, True), (base, True)]
        elif "cpu" in controllers.split(","):
            places = [(base / folder / relative, False) for folder in (controllers, "cpu,cpuacct", "cpu")]
            places += [(base / folder, False) for folder in (controllers, "cpu,cpuacct", "cpu")]
        else:
            continue
        for folder, v2 in places:
            if (folder / "cpu.stat").is_file():
                return Cgroup(folder / "cpu.stat", v2)
    return None


class CgroupCollector:
    """The cgroup's figures as metric families, read at each scrape (`docs`: each family's name, without
    `_total`, to its help text, from metrics.METRICS). A figure the kernel does not give has no series."""

    def __init__(self, cgroup: Cgroup | None, docs: dict[str, str]) -> None:
        self.cgroup, self.docs = cgroup, docs

    def collect(self) -> Iterator[Metric]:
        if self.cgroup is None:
            return
        try:
            values = self.cgroup.read()
        except (OSError, ValueError, KeyError):
            return
        for name, doc in self.docs.items():
            key = name.removeprefix("llmproxy_process_cpu_")
            if key not in values:
                continue
            family = GaugeMetricFamily(name, doc) if key == "limit_cores" else CounterMetricFamily(name, doc)
            family.add_metric([], values[key])
            yield family


class LoopLag:
    """How late the event loop runs a timer: one set every `every_s` on average, each wait drawn between half and one
    and a half of it (a fixed one would lock onto a CPU quota's period, 100 ms, each timer falling due just after the
    throttling ends, and see none of it: tests/test_cpu.py found it). A plain timer callback, no task: a few µs each."""

    def __init__(self, observe: Callable[[float], None], busy: Callable[[], bool] = lambda: True, every_s: float = PROBE_S) -> None:
        self.observe, self.busy, self.every_s = observe, busy, every_s
        self.draw = random.Random()
        self.due_ns = 0
        self.handle: asyncio.TimerHandle | None = None
        self.idle = True

    def wake(self) -> None:
        """A request came to an idle proxy: the next timer at the busy pace, not at the idle one."""
        if self.idle and self.handle is not None:
            self.handle.cancel()
            self.start()

    def start(self) -> None:
        # Idle (no request in flight), a timer every IDLE_S: on this VM a wake-up costs a process 0.05-0.25 ms of CPU (a bare
        # uvloop timer at four a second: 0.65 ms a second), and no stream waits on the loop then.
        self.idle = not self.busy()
        wait_s = (IDLE_S if self.idle else self.every_s) * (0.5 + self.draw.random())
        self.due_ns = time.monotonic_ns() + int(wait_s * 1e9)
        self.handle = asyncio.get_running_loop().call_later(wait_s, self._fired)

    def _fired(self) -> None:
        if self.busy():
            self.observe(max(0, time.monotonic_ns() - self.due_ns) / 1e9)
        self.start()

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
