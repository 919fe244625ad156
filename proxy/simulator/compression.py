"""The simulator's compressed responses (`x-sim-content-encoding: gzip | deflate | br | zstd`), as
CDNs and hosted APIs send them: each body message compressed and flushed on its own, so a stream
stays a stream; only when the request's `accept-encoding` allows it, unless `x-sim-force-encoding: 1`;
`x-sim-corrupt-encoding: 1` labels bytes that are not what the header says."""
from __future__ import annotations

import zlib
from typing import Any, Awaitable, Callable

import brotli
import zstandard

Send = Callable[[dict[str, Any]], Awaitable[None]]


def _compressor(encoding: str) -> tuple[Callable[[bytes], bytes], Callable[[], bytes]]:
    """(compress one message and flush it, finish the stream)."""
    if encoding in ("gzip", "deflate"):
        deflate = zlib.compressobj(wbits=16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        return lambda data: deflate.compress(data) + deflate.flush(zlib.Z_SYNC_FLUSH), deflate.flush
    if encoding == "br":
        compressor = brotli.Compressor()
        return lambda data: compressor.process(data) + compressor.flush(), compressor.finish
    if encoding == "zstd":
        zstd = zstandard.ZstdCompressor().compressobj()
        return lambda data: zstd.compress(data) + zstd.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK), zstd.flush
    raise ValueError(f"x-sim-content-encoding: {encoding!r} is not gzip, deflate, br or zstd")


def encoded(send: Send, headers: dict[str, str]) -> Send:
    encoding = headers.get("x-sim-content-encoding", "")
    accepted = {part.split(";")[0].strip() for part in headers.get("accept-encoding", "").split(",")}
    if not encoding or (encoding not in accepted and headers.get("x-sim-force-encoding") != "1"):
        return send  # as servers do: only what the client accepts (unless told to ignore it, as some CDNs do)
    corrupt = headers.get("x-sim-corrupt-encoding") == "1"
    compress, finish = _compressor(encoding)

    async def compressed(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message["headers"] if k.lower() != b"content-length"]
            message = {**message, "headers": kept + [(b"content-encoding", encoding.encode())]}
        elif message["type"] == "http.response.body":
            data = message.get("body", b"")
            out = (b"\x00not-" + encoding.encode() + data) if corrupt else (compress(data) if data else b"")
            if not message.get("more_body") and not corrupt:
                out += finish()
            message = {**message, "body": out}
        await send(message)

    return compressed
