"""Trains the zstd dictionary the records stores compress each record's JSON with
(proxy/records/records.zdict; codec.py reads it).

    .venv/bin/python scripts/train_dictionary.py

A record is 1-2 KB of JSON whose keys and shape repeat from one to the next: compressed alone, zstd
finds little to remove (1.9x); with a dictionary of those keys and shapes, 5x, and 2x faster (the
store's inserts, and its disk, shrink with it: bench/RESULTS.md). The samples are records as the
proxy writes them (tests/fleet.py: every API, outcome, verdict and phase it records). A dictionary is
never changed once shipped: each compressed record names its dictionary's id, and codec.py keeps
every one it has shipped, so a record written with an older one is still read. A new one is a new
file beside it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import orjson
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import fleet  # noqa: E402

SIZE = 16 * 1024


def main() -> int:
    samples = [orjson.dumps(r) for r in fleet.records(20_000, 1_796_000_000 * 10**9, 86400.0, models=20, instances=4, seed=101)]  # (fixed: the same file each time)
    dictionary = zstandard.train_dictionary(SIZE, samples, dict_id=0x6C6D0001)
    path = ROOT / "proxy" / "records" / "records.zdict"
    path.write_bytes(dictionary.as_bytes())
    compressor = zstandard.ZstdCompressor(level=1, dict_data=dictionary)
    raw = sum(map(len, samples))
    packed = sum(len(compressor.compress(s)) for s in samples)
    print(f"wrote {path.relative_to(ROOT)} ({len(dictionary.as_bytes()):,} bytes, id {dictionary.dict_id():#x}): "
          f"{raw / len(samples):.0f} bytes a record, {packed / len(samples):.0f} compressed ({raw / packed:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
