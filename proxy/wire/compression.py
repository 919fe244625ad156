"""Reading compressed upstream bytes: a streaming decoder per `content-encoding`.

The client always gets the upstream's bytes as they came; the proxy decodes a copy, read by read,
so that each read keeps its own timestamp (gzip and deflate with zlib, `br` with Google's `brotli`,
`zstd` with `zstandard`). Output per read is bounded (`limit`), so a small compressed read cannot
expand into unbounded memory (a decompression bomb): a read that would exceed it fails to decode,
and the request is counted as unmeasured, never broken.
"""
from __future__ import annotations

import zlib
from typing import Callable

import brotli
import zstandard

ENCODINGS = (b"gzip", b"deflate", b"br", b"zstd")  # what the proxy can read (x-gzip is gzip)


class DecodeError(Exception):
    """The bytes are not valid for their content-encoding (or expand past the limit)."""


class Decoder:
    """One response body's decoder: `feed` each read, get the decoded bytes so far."""

    __slots__ = ("_feed", "limit")

    def __init__(self, encoding: bytes, limit: int) -> None:
        self.limit = limit
        self._feed = _decoder(encoding.strip().lower(), limit)

    def feed(self, data: bytes) -> bytes:
        try:
            out = self._feed(data)
        except (zlib.error, brotli.error, zstandard.ZstdError) as exc:
            raise DecodeError(str(exc)) from exc
        if len(out) > self.limit:
            raise DecodeError(f"one read decodes to more than {self.limit} bytes")
        return out


def _decoder(encoding: bytes, limit: int) -> Callable[[bytes], bytes]:
    if encoding in (b"gzip", b"x-gzip"):
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        return lambda data: inflate.decompress(data, limit + 1)
    if encoding == b"deflate":
        return _Deflate(limit)
    if encoding == b"br":
        unbrotli = brotli.Decompressor()
        return lambda data: unbrotli.process(data, output_buffer_limit=limit + 1)
    if encoding == b"zstd":
        unzstd = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True)
        return unzstd.decompress
    raise DecodeError(f"content-encoding {encoding.decode('latin-1')!r} is not one the proxy reads")


class _Deflate:
    """HTTP's `deflate` is zlib-wrapped, but some servers send raw deflate: decided on the first read."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._inflate: "zlib._Decompress | None" = None

    def __call__(self, data: bytes) -> bytes:
        if self._inflate is None:
            self._inflate = zlib.decompressobj(zlib.MAX_WBITS)
            try:
                return self._inflate.decompress(data, self.limit + 1)
            except zlib.error:
                self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)
        return self._inflate.decompress(data, self.limit + 1)


def readable(encoding: bytes) -> bool:
    """Identity, or an encoding the proxy decodes."""
    encoding = encoding.strip().lower()
    return encoding in (b"", b"identity", b"x-gzip") or encoding in ENCODINGS


def decompress(raw: bytes, encoding: bytes, limit: int = 64 * 1024 * 1024) -> bytes:
    """A whole body, decoded (identity: as it is)."""
    encoding = encoding.strip().lower()
    if encoding in (b"", b"identity"):
        return raw
    return Decoder(encoding, limit).feed(raw)
