"""Writes requirements.lock from a `pip install --dry-run --report` JSON (runtime dependencies only)."""
import json
import sys

report = json.load(open(sys.argv[1]))
pins = sorted(f"{item['metadata']['name'].lower()}=={item['metadata']['version']}" for item in report["install"]
              if item["metadata"]["name"] != "llm-latency-proxy")
with open(sys.argv[2], "w") as out:
    out.write("# Runtime dependencies as resolved for this release (make lock); audited by make audit.\n" + "\n".join(pins) + "\n")
