"""The vLLM tier reuses the main suite's helpers (tests/servers.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
