"""`python -m bench.fleet SUBCOMMAND [flags]`: one of this tool's benchmarks (bench/harness.py: `dispatch`)."""
from bench.harness import dispatch

raise SystemExit(dispatch("bench.fleet"))
