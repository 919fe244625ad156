"""The vLLM tier reuses the main suite's helpers (tests/servers.py)."""
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# Records databases go to a directory of this session, as in the main suite.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="llmproxy-test-data-")
