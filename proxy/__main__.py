"""`python -m proxy`: the command line (cli.py)."""
from .cli import main

if __name__ == "__main__":  # guarded: the offload worker process (spawn) imports this module again
    raise SystemExit(main())
