"""Store version 2 (before tenants): what its replicas created and write, made from this version's
schema by taking back what version 3 added (the tenant and end-user columns, their indexes, the
rollup's tenant and its sums) and what later versions did (version 4's boots, version 5's model_name, version 6's
phase lag), so that a test can migrate a store of version 2 while an old replica
keeps writing to it, as in a rolling upgrade."""
from __future__ import annotations

import json
from typing import Any

from proxy.records import Writer, codec
from proxy.records import columns as C
from proxy.records import sql as A

V3_COLUMNS = ("tenant", "user_id", "ph_failover")
LATER_COLUMNS = ("model_name", "ph_lag")  # (version 5's, 6's)
COLUMNS = tuple(c for c in C.COLUMNS if c not in V3_COLUMNS + LATER_COLUMNS)
DIMENSIONS = tuple(d for d in C.DIMENSIONS if d != "tenant")
SUMS = tuple(s for s in A.SUMS if s[0] not in A.V3_SUMS + A.V6_SUMS)
ROLLUP_COLUMNS = (*DIMENSIONS, *(name for name, _, _ in SUMS))


def downgrade(conn: Any, postgres: bool) -> None:
    """A store of this version back to version 2's tables (empty ones: run before any write)."""
    for index in ("llmproxy_records_tenant", "llmproxy_records_user"):
        conn.execute(f"DROP INDEX IF EXISTS {index}")
    for column in V3_COLUMNS + LATER_COLUMNS:
        conn.execute(f"ALTER TABLE llmproxy_records DROP COLUMN {column}")
    for column in ("tenant", *A.V3_SUMS, *A.V6_SUMS):
        conn.execute(f"ALTER TABLE llmproxy_rollup DROP COLUMN {column}")
    conn.execute("DROP TABLE IF EXISTS llmproxy_boots")  # (version 4's)
    conn.execute(f"UPDATE {'llmproxy_meta' if postgres else 'meta'} SET value = '2' WHERE key = 'store_version'")
    conn.execute(f"DELETE FROM {'llmproxy_meta' if postgres else 'meta'} WHERE key = 'store_level'")


def write(conn: Any, records: list[dict[str, Any]], postgres: bool) -> None:
    """What a replica of version 2 writes for these records, in one transaction: its rows (no tenant,
    no end user) and its rollup (its dimensions and sums only, by name)."""
    p = "%s" if postgres else "?"
    rows = []
    for record in records:
        row = Writer.row(json.dumps({k: v for k, v in record.items() if k not in ("tenant", "user")}).encode())
        values = dict(zip(C.COLUMNS, C.values(row.rid, row.parsed())))
        dims = tuple(values[d] for d in DIMENSIONS)
        values["series"] = C._hash("\x00".join(dims))  # (version 2 hashed these dimensions)
        rows.append((*(values[c] for c in COLUMNS), codec.pack(row.data)))
    conn.execute("BEGIN")
    insert = f"INSERT INTO llmproxy_records ({', '.join(COLUMNS)}, data) VALUES ({', '.join([p] * (len(COLUMNS) + 1))}) ON CONFLICT DO NOTHING"
    (conn.cursor() if postgres else conn).executemany(insert, rows)
    ends = [r[COLUMNS.index("ended_ns")] for r in rows]
    block = f"ended_ns / {A.BLOCK_NS} * {A.BLOCK_NS}"
    merge = ", ".join(f"{name} = llmproxy_rollup.{name} + excluded.{name}" if kind == "sum" else
                      f"{name} = {'LEAST' if postgres else 'min'}(llmproxy_rollup.{name}, excluded.{name})" if kind == "min" else
                      f"{name} = {'GREATEST' if postgres else 'max'}(llmproxy_rollup.{name}, excluded.{name})" for name, _, kind in SUMS)
    conn.execute(f"INSERT INTO llmproxy_rollup (start, series, {', '.join(ROLLUP_COLUMNS)}) SELECT {block}, series, {', '.join(DIMENSIONS)}, "
                 f"{', '.join(expr for _, expr, _ in SUMS)} FROM llmproxy_records WHERE ended_ns >= {p} AND ended_ns <= {p} "
                 f"AND rid = ANY({p}) GROUP BY {block}, series, {', '.join(DIMENSIONS)} "
                 f"ON CONFLICT (start, series) DO UPDATE SET {merge}" if postgres else
                 f"INSERT INTO llmproxy_rollup (start, series, {', '.join(ROLLUP_COLUMNS)}) SELECT {block}, series, {', '.join(DIMENSIONS)}, "
                 f"{', '.join(expr for _, expr, _ in SUMS)} FROM llmproxy_records WHERE ended_ns >= {p} AND ended_ns <= {p} "
                 f"AND rid IN (SELECT value FROM json_each({p})) GROUP BY {block}, series, {', '.join(DIMENSIONS)} "
                 f"ON CONFLICT (start, series) DO UPDATE SET {merge}",
                 (min(ends), max(ends), [r[0] for r in rows]) if postgres else (min(ends), max(ends), json.dumps([r[0] for r in rows])))
    conn.execute("COMMIT")
