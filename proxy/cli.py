"""The `llm-latency-proxy` command: serve, simulate, demo.

Imports of the app stay inside the commands: with `--workers N > 1`, prometheus-client's
multiprocess directory must be set (and emptied) before prometheus_client is first imported.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Sequence

from .config import add_arguments, build_settings

if TYPE_CHECKING:
    from .measure.slo import Objective
    from .records import Backend


def serve(args: argparse.Namespace) -> int:
    settings = build_settings(args)
    if settings.slo:  # refused at start, with its line, before any worker starts
        from .measure.slo import load as load_objectives

        load_objectives(settings.slo)
    if settings.tenants:
        from .serve.tenants import load as load_tenants

        load_tenants(settings.tenants)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .serve.server import run

    run(settings)
    return 0


def simulate(args: argparse.Namespace) -> int:
    import uvicorn

    from .simulator import SimConfig, Simulator

    config = SimConfig(prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, jitter=args.jitter,
                       chunk_tokens=args.chunk_tokens, default_max_tokens=args.max_tokens,
                       role_chunk=not args.no_role_chunk, usage_null_chunks=not args.no_usage_null,
                       deterministic=args.deterministic, seed=args.seed, batch_alpha_ms=args.batch_alpha_ms,
                       batch_beta_ms=args.batch_beta_ms, prefill_queue=args.prefill_queue, prefix_cache_tokens=args.prefix_cache_tokens)
    uvicorn.run(Simulator(config), host=args.host, port=args.port, loop="uvloop", http="httptools",
                log_level=args.log_level, access_log=False, timeout_keep_alive=args.keep_alive_timeout, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    return 0


def demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(repeats=args.repeats, output_tokens=args.output_tokens)


def _since_s(value: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if not value:
        return 0.0
    if value[-1] not in units:
        raise ValueError(f"--since: a duration such as 90s, 30m, 1h or 2d, not {value!r}")
    return float(value[:-1]) * units[value[-1]]


def _stores(args: argparse.Namespace, paths: list[str]) -> list[Backend]:
    """The stores named, each brought to this version's schema first (an older one's records moved in,
    which a proxy of this version would do on its own)."""
    from .records import COMMAND_READ_S, open_backend

    password_file = args.db_password_file or os.environ.get("LLMPROXY_RECORDS_DB_PASSWORD_FILE", "")
    stores = []
    for path in paths:
        if "://" not in path and not os.path.exists(path):
            raise ValueError(f"no records database at {path}")
        store = open_backend(path, password_file=password_file, read_s=COMMAND_READ_S)  # (a person waits: minutes, not the pages' 3 s)
        if store.pending():
            print(f"moving {store.pending():,} records of an older schema into {store.where} first", file=sys.stderr)
            store.open()
            while store.pending():
                store.maintain()
            store.close()
        stores.append(store)
    return stores


def explain(args: argparse.Namespace) -> int:
    import glob
    import time

    from .answers import budget
    from .answers.explain import explain as analyse
    from .answers.explain import gather, render, to_json
    from .config import default_records_path
    from .records.sql import Window

    paths = args.db or sorted(glob.glob(default_records_path(0).replace("records-0.sqlite", "records-*.sqlite")))
    if not paths:
        raise ValueError("no records database: pass --db PATH (the proxy's --records-db: a file, or postgresql://…)")
    since = _since_s(args.since)
    hardware = None
    if args.roofline:
        if not (args.params and args.bandwidth):
            raise ValueError("--roofline needs --params and --bandwidth")
        hardware = {"params": args.params, "bytes_per_param": args.bytes_per_param, "bandwidth": args.bandwidth,
                    "kv_bytes_per_token": args.kv_bytes_per_token}
    stores = _stores(args, paths)
    # --since from the start of the ten-minute block it falls in: every record before the last block is
    # read from the aggregates, none one by one (a day of a fleet in seconds; the window is 0-10 min longer).
    filters = (("model", args.model),) if args.model else ()
    window = Window(time.time_ns() - int(since * 1e9) if since else 0, filters + ((("tenant", args.tenant),) if args.tenant else ()),
                    whole_blocks=True)
    objectives: tuple[Objective, ...] = ()
    slo_path = args.slo or os.environ.get("LLMPROXY_SLO", "")
    if slo_path:
        from .measure.slo import load as load_objectives

        objectives = load_objectives(slo_path)
    if args.by == "tenant":  # whose requests are slow (ledger.py): from the rollup alone
        from .answers import ledger

        tenants = ledger.report(ledger.gather(stores, window), objectives)
        print(to_json(tenants) if args.json else ledger.render(tenants))
        return 0
    if args.tenant:
        raise ValueError("--tenant needs --by tenant (the fits are per model and upstream, over every tenant)")
    groups = gather(stores, window)
    report = analyse(groups, hardware, objectives)
    if args.json:
        print(to_json(report))
    else:
        for name, summary in budget.summary(groups.values(), objectives).items():
            print("\n".join(budget.render(name, summary)))
        print(render(report))
    if args.plot:
        from .answers.explain import plot

        plot(groups, report, args.plot)
    return 0


def records_export(args: argparse.Namespace) -> int:
    """Every record of the stores (since --since) as JSON lines, oldest first, each with its `id`."""
    import time

    from .records.transfer import export

    since = _since_s(args.since)
    export(_stores(args, args.db), time.time_ns() - int(since * 1e9) if since else 0, sys.stdout.buffer)
    return 0


def records_import(args: argparse.Namespace) -> int:
    """JSON lines from stdin into one store, through the proxy's own write path (the rollup included, the
    hours compacted); the ids it already holds are skipped. Memory is bounded by the writers' buffers."""
    from .records import open_backend
    from .records.transfer import run_import

    password_file = args.db_password_file or os.environ.get("LLMPROXY_RECORDS_DB_PASSWORD_FILE", "")
    done = run_import(sys.stdin.buffer, lambda: open_backend(args.db, password_file=password_file, bulk=True, max_age_s=args.max_age),
                      lambda line: print(line, file=sys.stderr))
    nulled = ", ".join(f"{name} {count:,}" for name, count in sorted(done.nulled.items()))
    print(f"{done.lines:,} lines read, {done.stored:,} records stored, {done.skipped:,} skipped (already held), {done.rejected - done.skewed:,} not records, "
          f"{done.skewed:,} outside the store's window (clock_skew), {done.dropped:,} dropped"
          f"{f', figures no column holds set to null: {nulled}' if nulled else ''}, {done.compacted:,} blocks and hours compacted "
          f"({done.final_s:.1f} s at the end); {done.seconds:.1f} s, {done.lines / max(done.seconds, 1e-9):,.0f} lines/s", file=sys.stderr)
    return 1 if done.dropped or done.rejected else 0


def rules(args: argparse.Namespace) -> int:
    from .answers.rules import render as render_rules
    from .measure.slo import load as load_objectives

    print(render_rules(load_objectives(args.slo), args.slo, kubernetes=args.kubernetes), end="")
    return 0


def tenants(args: argparse.Namespace) -> int:
    from .serve.tenants import main as tenants_main

    return tenants_main([args.tenants_command])


def load(args: argparse.Namespace) -> int:
    import asyncio

    from .simulator.load import SHAPES, run_load

    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else []
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()] if args.shapes else []
    if shapes and (len(shapes) != len(keys) or set(shapes) - set(SHAPES)):
        raise ValueError(f"--shapes: one per key in --keys, each one of {', '.join(SHAPES)}")
    result = asyncio.run(run_load(args.base_url, args.concurrency, args.duration, args.requests, seed=args.seed, keys=keys,
                                mixes=[SHAPES[s] for s in shapes] or None, users=args.users))
    print(f"sent {result.sent}, statuses {dict(sorted(result.statuses.items()))}, transport failures {result.failures}")
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="llm-latency-proxy", description="OpenAI-compatible proxy that measures where each request's time goes.")
    commands = root.add_subparsers(dest="command", required=True)
    p_serve = commands.add_parser("serve", help="run the proxy in front of an upstream")
    add_arguments(p_serve)
    p_serve.set_defaults(func=serve)

    p_sim = commands.add_parser("simulate", help="run the built-in simulated inference engine")
    p_sim.add_argument("--host", default="127.0.0.1")
    p_sim.add_argument("--port", type=int, default=8000)
    p_sim.add_argument("--prefill-tps", type=float, default=5000.0, help="prompt tokens per second (TTFT = prompt / this)")
    p_sim.add_argument("--decode-tps", type=float, default=100.0, help="output tokens per second per request")
    p_sim.add_argument("--jitter", type=float, default=0.0, help="relative random spread of each inter-token gap (0.1 = ±10%%)")
    p_sim.add_argument("--chunk-tokens", type=int, default=1, help="tokens per streamed content chunk")
    p_sim.add_argument("--max-tokens", type=int, default=100, help="output tokens when a request sets none")
    p_sim.add_argument("--no-role-chunk", action="store_true", help="omit the role-only first chunk")
    p_sim.add_argument("--no-usage-null", action="store_true", help="omit usage:null on chunks (vLLM style)")
    p_sim.add_argument("--deterministic", action="store_true", help="fixed `created` field for byte comparisons")
    p_sim.add_argument("--seed", type=int, default=0)
    p_sim.add_argument("--batch-alpha-ms", type=float, default=0.0,
                       help="continuous batching: ms per token at no load (with --batch-beta-ms: per token = alpha + beta x streams decoding)")
    p_sim.add_argument("--batch-beta-ms", type=float, default=0.0, help="continuous batching: ms per token added by each stream decoding at once")
    p_sim.add_argument("--prefill-queue", action="store_true", help="one prefill at a time, first come first served (an engine's queue)")
    p_sim.add_argument("--prefix-cache-tokens", type=int, default=0,
                       help="a prefix cache of this many tokens: prompts it has seen prefill only what is new, usage reports cached tokens")
    p_sim.add_argument("--log-level", default="warning")
    p_sim.add_argument("--keep-alive-timeout", type=float, default=5.0,
                       help="seconds before an idle client connection is closed (uvicorn's default 5, as vLLM; large: never)")
    p_sim.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (and --ssl-certfile)")
    p_sim.add_argument("--ssl-certfile", default=None)
    p_sim.set_defaults(func=simulate)

    p_demo = commands.add_parser("demo", help="simulator + proxy + the seed's four cases, measured")
    p_demo.add_argument("--repeats", type=int, default=3, help="requests per case (the table shows medians)")
    p_demo.add_argument("--output-tokens", type=int, default=100)
    p_demo.set_defaults(func=demo)

    p_explain = commands.add_parser("explain", help="the latency budget of recorded traffic: fits, split, crossover, what-ifs")
    p_explain.add_argument("--db", action="append", default=[],
                           help="records store: an SQLite file (repeat: one per replica; default: this machine's) or a fleet's postgresql://… URL")
    p_explain.add_argument("--db-password-file", default="", help="file holding the PostgreSQL password (default: $LLMPROXY_RECORDS_DB_PASSWORD_FILE)")
    p_explain.add_argument("--since", default="", help="only requests that ended in this window: 90s, 30m, 1h, 2d")
    p_explain.add_argument("--model", default="")
    p_explain.add_argument("--by", choices=["model", "tenant"], default="model",
                           help="model: per model and upstream, the fits (default); tenant: per tenant, attainment, budget spent, blame and the split")
    p_explain.add_argument("--tenant", default="", help="with --by tenant: only this tenant")
    p_explain.add_argument("--json", action="store_true", help="the whole report as JSON")
    p_explain.add_argument("--plot", default="", help="write the fits as a PNG here (needs matplotlib: the [plot] extra)")
    p_explain.add_argument("--roofline", action="store_true", help="compare decode with the bandwidth-bound ceiling (needs --params, --bandwidth)")
    p_explain.add_argument("--params", type=float, default=0.0, help="model parameters, e.g. 7e9")
    p_explain.add_argument("--bytes-per-param", type=float, default=2.0)
    p_explain.add_argument("--bandwidth", type=float, default=0.0, help="memory bandwidth in bytes/s, e.g. 3.35e12")
    p_explain.add_argument("--kv-bytes-per-token", type=float, default=0.0)
    p_explain.add_argument("--slo", default="", help="the objectives file (serve's --slo; default $LLMPROXY_SLO): targets, budget left, capacity")
    p_explain.set_defaults(func=explain)

    p_rules = commands.add_parser("rules", help="Prometheus burn-rate alerts (multiwindow, multi-burn-rate) from an objectives file")
    p_rules.add_argument("--slo", required=True, help="the objectives file (serve's --slo)")
    p_rules.add_argument("--kubernetes", action="store_true", help="a PrometheusRule for the Prometheus Operator instead of a rules file")
    p_rules.set_defaults(func=rules)

    p_records = commands.add_parser("records", help="move records between stores: export as JSON lines, import them")
    records_commands = p_records.add_subparsers(dest="records_command", required=True)
    p_export = records_commands.add_parser("export", help="write every record (since --since) as JSON lines, each with its stable id")
    p_export.add_argument("--db", action="append", required=True, help="records store: an SQLite file or postgresql://… (repeat: several)")
    p_export.add_argument("--db-password-file", default="", help="file holding the PostgreSQL password (default: $LLMPROXY_RECORDS_DB_PASSWORD_FILE)")
    p_export.add_argument("--since", default="", help="only requests that ended in this window: 90s, 30m, 1h, 2d")
    p_export.set_defaults(func=records_export)
    p_import = records_commands.add_parser("import", help="read JSON lines from stdin into a store (the ids it holds are skipped)")
    p_import.add_argument("--db", required=True, help="records store: an SQLite file or postgresql://…")
    p_import.add_argument("--db-password-file", default="", help="file holding the PostgreSQL password (default: $LLMPROXY_RECORDS_DB_PASSWORD_FILE)")
    p_import.add_argument("--max-age", type=float, default=7 * 24 * 3600.0,
                          help="the store's retention in seconds, as its proxies' --records-max-age (0: none): a record that ended "
                               "earlier, or more than an hour from now, is not imported (counted as clock_skew)")
    p_import.set_defaults(func=records_import)

    p_tenants = commands.add_parser("tenants", help="the tenants file's helpers: `fingerprint` prints each key on stdin as its fingerprint")
    p_tenants.add_argument("tenants_command", choices=["fingerprint"])
    p_tenants.set_defaults(func=tenants)

    p_load = commands.add_parser("load", help="send a bounded traffic mix (chat/completions, stream or not, some errors)")
    p_load.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p_load.add_argument("--concurrency", type=int, default=4)
    p_load.add_argument("--duration", type=float, default=30.0, help="seconds (the loop always stops)")
    p_load.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    p_load.add_argument("--seed", type=int, default=0)
    p_load.add_argument("--shapes", default="", help="with --keys: each key's traffic, comma-separated: default, long-prompts, long-answers")
    p_load.add_argument("--users", type=int, default=0, help="each request names one of this many end users (the API's own `user` field)")
    p_load.add_argument("--keys", default="", help="comma-separated API keys: each request carries one in turn (tenants told apart by key)")
    p_load.set_defaults(func=load)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad settings: one clear line, no traceback
        print(f"llm-latency-proxy: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from .records import Unavailable  # (imported here: a command that never reads a store does not load them)

        if not isinstance(exc, Unavailable):
            raise
        print(f"llm-latency-proxy: the records store did not answer: {exc}", file=sys.stderr)  # (in time, or at all)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
