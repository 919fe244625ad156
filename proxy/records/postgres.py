"""The records store of a fleet: PostgreSQL (`--records-db postgresql://USER@HOST:PORT/DB`). Every
replica writes to one table; every reader (`explain --db postgresql://…`, `/llmproxy/requests` and
`/ui` on any replica) sees all of them, each record tagged with its `instance`.

- Driver: psycopg 3, on the writer thread (libpq releases the GIL while it waits on the network).
  asyncpg was measured beside it: 2 µs less CPU per record, but it wants an event loop of its own
  (bench/RESULTS.md, "One records store for the fleet").
- Writes: one transaction per batch: COPY into a temporary staging table, then `INSERT … SELECT …
  ON CONFLICT (rid) DO NOTHING`, so a batch sent again after a lost commit reply is stored once.
  `data` is `json` (kept as text: jsonb parses every record on the server, 3× slower to insert).
- Schema: versioned in `llmproxy_meta`, created or migrated when a replica opens the store, under
  a transaction-level advisory lock (replicas start together); a newer version is refused.
- Retention: every `RETAIN_EVERY_S`, by whichever replica takes the retention lock (the others skip):
  indexed deletes, `RETAIN_CHUNK` rows at a time for at most `RETAIN_BUDGET_S`, by age
  (`--records-max-age`) and by rows (`--records-max-rows`, the oldest ids first).
- The password comes from the URL, `--records-db-password-file` (a mounted Secret, re-read at each
  connect) or libpq's own `PGPASSWORD` / `PGPASSFILE`; log lines name the store by `redact(url)`.
"""
from __future__ import annotations

import re
import time
from typing import Any

import orjson
import psycopg

from . import Filters, Rejected, Row, Unavailable

SCHEMA_VERSION = 1
TABLE = "llmproxy_requests"
MIGRATE_LOCK, RETAIN_LOCK = 0x6C6D7001, 0x6C6D7002  # advisory lock keys ("lm" p 1, 2)
RETAIN_EVERY_S = 5.0
RETAIN_CHUNK = 10_000
RETAIN_BUDGET_S = 1.0
COLUMNS = ("rid", "ended_ns", "instance", "pid", "model", "upstream", "endpoint", "stream", "outcome", "api", "slo", "slo_good", "data")
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS llmproxy_meta (key text PRIMARY KEY, value text NOT NULL)",
    f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- insertion order across replicas: the oldest go first
        rid text NOT NULL,                                   -- instance/pid/boot/seq: a batch written twice is stored once
        ended_ns bigint NOT NULL,                            -- wall clock (epoch ns) when the request ended
        instance text NOT NULL, pid integer NOT NULL,
        model text NOT NULL, upstream text NOT NULL, endpoint text NOT NULL, stream boolean NOT NULL, outcome text NOT NULL,
        api text NOT NULL, slo text, slo_good boolean,
        data json NOT NULL                                   -- the record (proxy.telemetry.record_dict)
    )""",
    f"CREATE UNIQUE INDEX IF NOT EXISTS {TABLE}_rid ON {TABLE} (rid)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_ended ON {TABLE} (ended_ns)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_model ON {TABLE} (model, upstream, ended_ns)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_instance ON {TABLE} (instance, id)",
)
MIGRATIONS: dict[int, tuple[str, ...]] = {}  # version N -> the statements that make it N + 1 (none yet)
STAGING = f"CREATE TEMP TABLE llmproxy_staging ON COMMIT DELETE ROWS AS SELECT {', '.join(COLUMNS)} FROM {TABLE} WITH NO DATA"


def redact(url: str) -> str:
    """The URL with its password replaced: what log lines and errors may show."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def connect(url: str, password_file: str = "", **options: Any) -> psycopg.Connection[Any]:
    """A connection (autocommit: transactions are explicit); the password file, when given, wins."""
    kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": 5, "application_name": "llm-latency-proxy", **options}
    if password_file:
        with open(password_file, encoding="utf-8") as handle:
            kwargs["password"] = handle.read().strip()
    return psycopg.connect(url, **kwargs)


def _scrubbed(exc: BaseException, url: str) -> str:
    """An error's text with no password in it, whatever the driver echoed."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    password = re.search(r"://[^:/@]+:([^@]*)@", url)
    return redact(text.replace(password.group(1), "***") if password and password.group(1) else text)


def migrate(conn: psycopg.Connection[Any]) -> None:
    """Create the schema or bring it to this version, one replica at a time; refuse a newer one."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
        conn.execute(SCHEMA[0])
        row = conn.execute("SELECT value FROM llmproxy_meta WHERE key = 'schema_version'").fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise Unavailable(f"the records schema is version {version}, newer than this proxy's {SCHEMA_VERSION}: not written")
        if version == 0:
            for statement in SCHEMA[1:]:
                conn.execute(statement)
        for step in range(max(1, version), SCHEMA_VERSION):
            for statement in MIGRATIONS[step]:
                conn.execute(statement)
        conn.execute("INSERT INTO llmproxy_meta (key, value) VALUES ('schema_version', %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                     (str(SCHEMA_VERSION),))


class PostgresBackend:
    def __init__(self, url: str, max_rows: int, max_age_s: float, password_file: str = "") -> None:
        self.url, self.password_file = url, password_file
        self.where = redact(url)
        self.max_rows, self.max_age_s = max_rows, max_age_s
        self.conn: psycopg.Connection[Any] | None = None

    def open(self) -> None:
        try:
            conn = connect(self.url, self.password_file, options="-c statement_timeout=30000")
            migrate(conn)
            conn.execute(STAGING)
        except psycopg.Error as exc:
            raise Unavailable(_scrubbed(exc, self.url)) from None
        except OSError as exc:  # the password file
            raise Unavailable(f"{self.password_file}: {exc.strerror or exc}") from None
        self.conn = conn

    def write(self, rows: list[Row]) -> None:
        conn = self.conn
        assert conn is not None
        names = ", ".join(COLUMNS)
        try:
            with conn.transaction():
                with conn.cursor().copy(f"COPY llmproxy_staging ({names}) FROM STDIN") as copy:
                    for r in rows:
                        copy.write_row((r.rid, r.ended_ns, r.instance, r.pid, r.model, r.upstream, r.endpoint, r.stream, r.outcome, r.api,
                                        r.slo, r.slo_good, r.data.decode()))
                conn.execute(f"INSERT INTO {TABLE} ({names}) SELECT {names} FROM llmproxy_staging ON CONFLICT (rid) DO NOTHING")
        except (psycopg.errors.DataError, psycopg.errors.IntegrityError) as exc:  # what these rows hold
            raise Rejected(_scrubbed(exc, self.url)) from None
        except psycopg.Error as exc:  # down, restarting, slow, the table gone: reconnect (and migrate) and retry
            self.close()
            raise Unavailable(_scrubbed(exc, self.url)) from None

    def retain(self) -> None:
        """Delete beyond the age and row limits, in chunks, within a time budget; one replica at a time."""
        conn = self.conn
        if conn is None or not (self.max_age_s > 0 or self.max_rows > 0):
            return
        began = time.monotonic()
        try:
            with conn.transaction():
                if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (RETAIN_LOCK,)).fetchone()[0]:  # type: ignore[index]
                    return  # another replica is at it
                if self.max_age_s > 0:
                    cutoff = time.time_ns() - int(self.max_age_s * 1e9)
                    while time.monotonic() - began < RETAIN_BUDGET_S:
                        deleted = conn.execute(f"DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE} WHERE ended_ns < %s LIMIT %s)",
                                               (cutoff, RETAIN_CHUNK)).rowcount
                        if deleted < RETAIN_CHUNK:
                            break
                if self.max_rows > 0:
                    row = conn.execute(f"SELECT id FROM {TABLE} ORDER BY id DESC OFFSET %s LIMIT 1", (self.max_rows,)).fetchone()
                    while row is not None and time.monotonic() - began < RETAIN_BUDGET_S:
                        deleted = conn.execute(f"DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE} WHERE id <= %s ORDER BY id LIMIT %s)",
                                               (row[0], RETAIN_CHUNK)).rowcount
                        if deleted < RETAIN_CHUNK:
                            break
        except psycopg.Error as exc:
            self.close()
            raise Unavailable(_scrubbed(exc, self.url)) from None

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg.Error:
                pass  # (already broken: closing it is all that was left)
            self.conn = None

    def recent(self, limit: int, filters: Filters) -> list[dict[str, Any]]:
        return recent(self.url, limit, filters, self.password_file)


def _where(filters: Filters) -> tuple[str, list[Any]]:
    where = [f"{name} = %s" for name, _ in filters.equal()]
    args: list[Any] = [value for _, value in filters.equal()]
    if filters.verdict:
        where.append("slo_good = %s")
        args.append(filters.verdict == "good")
    return (f"WHERE {' AND '.join(where)}" if where else ""), args


def recent(url: str, limit: int, filters: Filters = Filters(), password_file: str = "") -> list[dict[str, Any]]:
    """The fleet's newest `limit` records, oldest first (every replica's; `instance` selects one)."""
    clause, args = _where(filters)
    with connect(url, password_file) as conn:
        try:
            rows = conn.execute(f"SELECT data::text FROM {TABLE} {clause} ORDER BY id DESC LIMIT %s", (*args, max(0, limit))).fetchall()
        except psycopg.errors.UndefinedTable:
            return []  # no replica has written yet
    return [orjson.loads(row[0]) for row in reversed(rows)]


def load(url: str, cutoff_ns: int, model: str = "", password_file: str = "") -> list[dict[str, Any]]:
    """Every replica's records since `cutoff_ns` (for `explain`), streamed from a server-side cursor."""
    query = f"SELECT data::text, upstream FROM {TABLE} WHERE ended_ns >= %s"
    args: list[Any] = [cutoff_ns]
    if model:
        query += " AND model = %s"
        args.append(model)
    out: list[dict[str, Any]] = []
    with connect(url, password_file) as conn:
        if conn.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is None:  # type: ignore[index]
            return out
        with conn.transaction(), conn.cursor(name="llmproxy_explain") as cursor:
            cursor.itersize = 5000
            cursor.execute(query, args)
            for data, upstream in cursor:
                record = orjson.loads(data)
                record.setdefault("upstream", upstream)
                out.append(record)
    return out
