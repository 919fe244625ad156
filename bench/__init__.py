"""The benchmarks: a few tools over one harness (harness.py), each a question with subcommands. Run from the
project's root: `.venv/bin/python -m bench.TOOL SUBCOMMAND [flags]`; `-m bench.TOOL` alone lists its subcommands.
"""
