"""A slow client never rewrites the engine's timings: the relay reads the upstream ahead of it (each
read keeps its own stamp), and when the read-ahead is full it stops reading and marks the request
`client_backpressure`, kept out of the decode figures. Real sockets: the simulator sends 12 MB
(500 events of 24 KB: logprobs-sized) at 500 tok/s; a raw client reads them at 2 MB/s with a small
receive buffer, so the kernel's buffers hide no more than a few MB."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from proxy.processes import free_port

from servers import Process, Simulator, scraped

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOKENS, TPS, EVENT_BYTES, CLIENT_BPS = 500, 500, 24_000, 2_000_000


def dechunk(raw: bytes) -> bytes:
    """An HTTP/1.1 chunked body, decoded."""
    out, pos = bytearray(), 0
    while True:
        end = raw.index(b"\r\n", pos)
        size = int(raw[pos:end], 16)
        if size == 0:
            return bytes(out)
        out += raw[end + 2:end + 2 + size]
        pos = end + 4 + size


def slow_read(port: int, headers: dict[str, str], rate_bps: float, leave_after: int = 0, tokens: int = TOKENS) -> bytes:
    """The response body, read no faster than `rate_bps` (or only `leave_after` bytes, then gone)."""
    body = json.dumps({"model": "sim-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": tokens, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", port))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                 f"{head}\r\n".encode() + body)
    got, began = bytearray(), time.monotonic()
    while not got.endswith(b"0\r\n\r\n"):
        data = sock.recv(16384)
        if not data:
            break
        got += data
        if leave_after and len(got) >= leave_after:
            break
        ahead = len(got) / rate_bps - (time.monotonic() - began)
        if ahead > 0:
            time.sleep(ahead)
    sock.close()
    head_end = got.index(b"\r\n\r\n") + 4
    return dechunk(bytes(got[head_end:])) if not leave_after else b""


SCHEDULE = {"x-sim-ttft-ms": "10", "x-sim-decode-tps": str(TPS), "x-sim-event-bytes": str(EVENT_BYTES)}


def test_a_slow_reader_leaves_the_true_decode_rate_or_a_request_marked_and_kept_out(sim, tmp_path):
    other = Simulator()  # (each its own simulator: each tells what it sent)
    roomy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(p1 := free_port())], f"http://127.0.0.1:{p1}/healthz")
    tight = Process(["serve", "--upstream", f"{other.url}/v1", "--port", str(p2 := free_port()), "--stream-buffer-bytes", str(256 * 1024)],
                    f"http://127.0.0.1:{p2}/healthz")
    bodies: dict[int, bytes] = {}
    try:
        threads = [threading.Thread(target=lambda port=port: bodies.__setitem__(port, slow_read(port, SCHEDULE, CLIENT_BPS))) for port in (p1, p2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        delivered = {p1: sim.delivered(), p2: other.delivered()}  # (before the direct request below replaces them)
        direct = httpx.post(f"{sim.url}/v1/chat/completions", headers=SCHEDULE, timeout=60,
                            json={"model": "sim-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": TOKENS, "stream": True}).content
        time.sleep(0.5)
        records = {port: httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": 1}).json()[-1] for port in (p1, p2)}
        metrics = {port: (scraped(f"http://127.0.0.1:{port}", "llmproxy_unmeasured_requests_total", reason="client_backpressure"),
                          scraped(f"http://127.0.0.1:{port}", "llmproxy_decode_tokens_per_second_count"),
                          scraped(f"http://127.0.0.1:{port}", "llmproxy_inter_token_latency_seconds_count")) for port in (p1, p2)}
    finally:
        roomy.stop()
        tight.stop()
        other.proc.stop()
    assert len(direct) > 11_000_000 and bodies[p1] == bodies[p2] == direct  # unchanged and in order, every byte
    roomy_r, tight_r = records[p1], records[p2]
    # Read ahead (8 MiB by default): every read kept its stamp: the engine's 500 tok/s, to the simulator's own window.
    print(f"\nroomy: decode {roomy_r['decode_tokens_per_second']:.1f} tok/s, decode_s {roomy_r['decode_s']:.3f} s against the simulator's "
          f"{delivered[p1].window_s():.3f} s; client blocked {roomy_r['client_blocked_s']:.2f} s, client phase {roomy_r['phases_s']['client']:.2f} s; "
          f"tight: {tight_r['decode_tokens_per_second']:.1f} tok/s, read held {tight_r['read_held_s']:.2f} s")
    assert roomy_r["unmeasured"] == "" and roomy_r["read_held_s"] == 0
    # (within 5 ms: a relay that drained what it had read ahead in one go, reading no socket meanwhile, stamped the
    # stream's last events 13-30 ms late)
    assert delivered[p1].holds_window(roomy_r["decode_s"]), (roomy_r["decode_s"], delivered[p1])
    assert roomy_r["client_blocked_s"] > 1.0  # the client was slow, and the record says so
    # What the engine finished before the client: the client's own time, not the proxy's.
    assert roomy_r["phases_s"]["client"] > 1.0 and roomy_r["phases_s"]["proxy"] < 0.25, roomy_r["phases_s"]
    assert metrics[p1] == (0, 1, TOKENS - 1)
    # A 256 KiB read-ahead fills: reading paused, the later stamps are the client's pace: marked, kept out.
    assert tight_r["unmeasured"] == "client_backpressure" and tight_r["read_held_s"] > 0.5
    # (Its decode_s may still be the engine's: the kernel's stamps are true as long as the socket's own buffer took every
    # write in time, which depends on the kernel's autotuning, not on the proxy. Once a read held, the proxy cannot tell,
    # so the mark is the promise, not the figure; the figure is kept out of the rates below.)
    assert metrics[p2] == (1, 0, 0)


def test_a_client_that_leaves_frees_its_read_ahead_at_once(sim):
    port = free_port()
    proxy = Process(["serve", "--upstream", f"{sim.url}/v1", "--port", str(port)], f"http://127.0.0.1:{port}/healthz")
    try:
        disconnects = sim.stats()["disconnects"]
        # 2,000 events at 400 tok/s (5 s, 48 MB): after the kernel's buffers, megabytes are read ahead when
        # the client leaves at 1 MB, and the engine is still generating (held back by the full read-ahead).
        still_sending = {**SCHEDULE, "x-sim-decode-tps": "400"}
        reader = threading.Thread(target=slow_read, args=(port, still_sending, 500_000), kwargs={"leave_after": 1_000_000, "tokens": 2000})
        reader.start()
        deadline = time.monotonic() + 10
        peak = 0.0
        while reader.is_alive() and time.monotonic() < deadline:
            peak = max(peak, scraped(f"http://127.0.0.1:{port}", "llmproxy_read_ahead_bytes"))
            time.sleep(0.1)
        reader.join()
        time.sleep(1.5)  # (the gauge is sampled every second)
        after = scraped(f"http://127.0.0.1:{port}", "llmproxy_read_ahead_bytes")
        record = httpx.get(f"http://127.0.0.1:{port}/llmproxy/requests", params={"limit": 1}).json()[-1]
    finally:
        proxy.stop()
    assert peak > 1_000_000 and after == 0, (peak, after)  # megabytes read ahead of the client, then none
    assert record["outcome"] == "client_disconnect" and sim.stats()["disconnects"] == disconnects + 1  # the upstream closed too
