"""A record's JSON as the stores keep it: zstd-compressed with a dictionary of the records' keys and
shapes (`records.zdict`, trained by scripts/train_dictionary.py): 5x smaller (1.7 KB to 330 bytes),
which makes a store's inserts half as costly and its disk a third as large (bench/RESULTS.md).

Each compressed record names its dictionary's id; every dictionary ever shipped stays in `DICTIONARIES`,
so a record written with an older one is still read. Anything not zstd (a record stored by hand) is
read as the JSON it is.
"""
from __future__ import annotations

import threading
from importlib import resources
from typing import Any

import orjson
import zstandard

from ..wire.text import storable

MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame
DICTIONARIES = {0x6C6D0001: "records.zdict"}
CURRENT = 0x6C6D0001
LEVEL = 1  # (level 3 is 4% smaller and 2x slower)


def _dictionary(dict_id: int) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(resources.files(__package__).joinpath(DICTIONARIES[dict_id]).read_bytes())


class _Codec(threading.local):
    """Compressors are not thread-safe: one of each per thread (the writer's, a reader's)."""

    def __init__(self) -> None:
        self.dictionaries = {dict_id: _dictionary(dict_id) for dict_id in DICTIONARIES}
        self.compressor = zstandard.ZstdCompressor(level=LEVEL, dict_data=self.dictionaries[CURRENT], write_content_size=True)
        self.decompressors = {dict_id: zstandard.ZstdDecompressor(dict_data=d) for dict_id, d in self.dictionaries.items()}


_local = _Codec()


def pack(data: bytes) -> bytes:
    return _local.compressor.compress(data)


def unpack(blob: bytes) -> bytes:
    if not blob.startswith(MAGIC):
        return blob
    dict_id = zstandard.get_frame_parameters(blob).dict_id
    decompressor = _local.decompressors.get(dict_id)
    if decompressor is None:
        raise ValueError(f"a record compressed with dictionary {dict_id:#x}, which this version does not have")
    return decompressor.decompress(blob)


def serialise(record: dict[str, Any]) -> bytes:
    """A record's JSON; one holding a lone surrogate (that a sink upstream did not catch: orjson refuses it) made
    storable first. TypeError or ValueError: it cannot be (counted by the caller)."""
    try:
        return orjson.dumps(record)
    except TypeError:  # (orjson.JSONEncodeError)
        return orjson.dumps(_storable(record))


def _storable(value: Any) -> Any:
    """Every string in a record made storable (text.py), however deep."""
    if isinstance(value, str):
        return storable(value, len(value))
    if isinstance(value, dict):
        return {storable(str(k), len(str(k))): _storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_storable(v) for v in value]
    return value
