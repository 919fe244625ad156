"""Durable per-request records, written off the request path: one bounded buffer and one writer
thread per process, in front of one of two stores behind one small interface (`Backend`):

- `sqlite.py`: an embedded file (the default, `records-PORT.sqlite`): one command, no server;
- `postgres.py`: `--records-db postgresql://…`, one store for every replica of a fleet.

Why records at all: Prometheus histograms lose the joint distribution (prompt length, output
length, concurrency and timings of one request), which `explain` needs. The finisher hands each
finished record to `Writer.add` (serialised once, appended to the buffer: no I/O, no lock held for
long); the writer thread takes batches of up to `BATCH`, at most `FLUSH_S` old, and writes each in
one transaction. When the store is down, slow or refusing, the batch goes back to the front of the
buffer and the writer retries with a growing pause (`RETRY_S`): requests never wait on it. The
buffer holds at most `--records-buffer` records and `--records-buffer-bytes` bytes (one batch in
flight besides); past either cap the oldest records are dropped and counted
(`llmproxy_records_dropped_total{reason="buffer_full"}`), as are a batch the store refuses for what
it holds (`rejected`) and what is left when `close` runs out of time at shutdown (`shutdown`).
Records hold timings and counts only: no credential, no prompt or completion text.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import orjson

from .boots import Tally
from .columns import Columns
from .sql import Window

if TYPE_CHECKING:
    from .aggregate import Fold

log = logging.getLogger("llmproxy.records")

class Unavailable(Exception):
    """The store cannot take rows now (down, locked, slow): keep them and try again."""


class Rejected(Exception):
    """The store refuses these rows for what they hold: trying again cannot help (dropped, counted)."""


class Skewed(Rejected):
    """A record ending outside what the store keeps (columns.skew): dropped, counted as `clock_skew`."""


@dataclass(frozen=True, slots=True)
class Row:
    """One record on its way to a store: its JSON (which holds its `id`), and what orders and keys it.
    The store computes the typed columns and cells from the JSON (columns.py), on the writer thread."""

    rid: str  # the record's stable id: instance/pid/boot/seq for the proxy's own, or an imported record's `id`
    ended_ns: int  # when the request ended (wall clock, epoch ns): its partition and its hour in the aggregates
    data: bytes
    seq: int
    record: dict[str, Any] | None = None  # the JSON already parsed (an import's: not parsed twice); else the store parses it

    def parsed(self) -> dict[str, Any]:
        return self.record if self.record is not None else orjson.loads(self.data)


@dataclass(frozen=True)
class Filters:
    """What /llmproxy/requests (and /ui) may select by; empty: any. `verdict`: good or miss; `min_ttft`:
    seconds (0: any)."""

    model: str = ""
    upstream: str = ""
    outcome: str = ""
    api: str = ""
    slo: str = ""
    verdict: str = ""
    instance: str = ""
    min_ttft: float = 0.0
    tenant: str = ""
    user: str = ""  # the end user: a column of the records, not a dimension (the aggregates never see it)

    def equal(self) -> list[tuple[str, str]]:
        """(column, wanted value) for every filter that is an equality on a dimension (columns.DIMENSIONS)."""
        return [(name, value) for name in ("model", "upstream", "outcome", "api", "slo", "verdict", "instance", "tenant")
                if (value := getattr(self, name))]

    def where(self, mark: str) -> tuple[str, list[Any]]:
        """The SQL selection (` WHERE …`, or "") and its arguments, `mark` each argument's placeholder. A model is
        found under its own name, or under `other` with its name kept beside (columns.Columns: a writer's aggregates
        fold names past its cap, never its records)."""
        where: list[str] = []
        args: list[Any] = []
        for name, value in self.equal():
            if name == "model":
                where.append(f"(model = {mark} OR (model = 'other' AND model_name = {mark}))")
                args += [value, value]
            else:
                where.append(f"{name} = {mark}")
                args.append(value)
        if self.user:
            where.append(f"user_id = {mark}")
            args.append(self.user)
        if self.min_ttft:
            where.append(f"ttft_s >= {mark}")
            args.append(self.min_ttft)
        return (f" WHERE {' AND '.join(where)}" if where else ""), args

    def match(self, record: dict[str, Any]) -> bool:
        """The same selection on a record in memory (records off)."""
        return all(record.get(name) == want for name, want in self.equal() if name != "verdict") \
            and (not self.user or record.get("user") == self.user) \
            and (not self.verdict or record.get("slo_good") is (self.verdict == "good")) \
            and (not self.min_ttft or (record.get("ttft_s") or 0.0) >= self.min_ttft)


class Backend(Protocol):
    """One store. `open`, `write`, `retain` and `close` run on the writer thread only; the readers on
    any thread, each with a connection of its own."""

    where: str  # for log lines: a path, or a URL with no password
    retain_every_s: float  # how often the writer's maintenance thread runs `maintain`, busy or idle
    max_age_s: float  # how long it keeps a record (0: no limit): a record ending earlier is skew (columns.skew)
    columns: Columns  # what it makes of each record (columns.py): the figures it nulled, counted, taken by the writer
    step: str  # the maintenance step under way, or the last one (metrics.MAINTENANCE_STEPS): what a failure is counted as
    tally: Callable[[], Tally] | None  # the writer's own figures, for its boot's row (boots.py); None: not counted (an import)

    def open(self) -> None: ...  # connect and migrate; Unavailable if it cannot now

    def write(self, rows: list[Row]) -> int: ...  # one transaction, with the aggregates: how many were new; Unavailable or Rejected

    def maintain(self) -> tuple[int, int]: ...  # on its own connection: retention, partitions, compaction, migrations, boots
    # (records a crash lost, newly accounted; rows of an older schema that were no record, dropped)

    def closed(self, clean: bool = True) -> bool: ...  # the writer stops: its boot closed (not clean: its last figures); False: not written

    def close(self) -> None: ...

    def recent(self, limit: int, filters: Filters) -> list[bytes]: ...  # the newest records' JSON, oldest first

    def aggregate(self, into: Fold, window: Window, cells: bool = True) -> None: ...
    # (aggregate.queries' rows, by `into.by`: the sums and, with `cells`, the histograms, folded as they are read)

    def compact(self, before_ns: int = 1 << 62) -> int: ...  # on the writer's connection: what is due (ending before that) compacted now

    def samples(self, wanted: list[tuple[str, str, str, int]], window: Window) -> list[list[tuple[int, float, float]]]: ...
    # (each (fit, model, upstream, its points in the window)'s sample: (key, x, y), on one connection)

    def export(self, start_ns: int) -> Iterator[bytes]: ...  # every record's JSON since start_ns, oldest first

    def pending(self) -> int: ...  # records of an older schema not moved in yet


def is_postgres(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


COMMAND_READ_S = 600.0  # a read's deadline for a command a person waits on (`explain` over a week of a big fleet)


def open_backend(target: str, max_rows: int = -1, max_age_s: float = 7 * 86400.0, password_file: str = "",
                 busy_timeout_s: float = 5.0, bulk: bool = False, max_models: int = 100, known_models: tuple[str, ...] = (),
                 read_s: float | None = None) -> Backend:
    """The store a `--records-db` value names: a PostgreSQL URL, or an SQLite file path. `max_rows` -1:
    the store's own default. `bulk`: a load that can be run again (`records import`), whose commits
    need not wait for the server's WAL flush. `max_models`: model names its aggregates keep (--max-models), besides the
    configuration's own (`known_models`). `read_s`: how long a PostgreSQL read may take before it is cut (its
    statement_timeout and client-side deadline): by default the serving process's 3 s (its pages answer in seconds
    while the store is silent); a command passes COMMAND_READ_S."""
    if is_postgres(target):
        from .postgres import READ_S, PostgresBackend

        return PostgresBackend(target, max_rows, max_age_s, password_file, bulk, max_models, known_models, read_s or READ_S)
    from .sqlite import SQLiteBackend

    return SQLiteBackend(target, max_rows, max_age_s, busy_timeout_s, max_models, known_models)


from .codec import serialise  # noqa: E402
from .writer import BATCH, FLUSH_S, RETRY_S, Writer  # noqa: E402  (the writer needs the nouns above)

__all__ = ["BATCH", "COMMAND_READ_S", "FLUSH_S", "RETRY_S", "Backend", "Filters", "Rejected", "Row", "Skewed", "Unavailable", "Writer",
           "is_postgres", "open_backend", "serialise"]
