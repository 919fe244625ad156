"""The timing record: explicit instants in, exact durations and phases out."""
import pytest

from proxy.measure.timing import NS, RequestTiming, split

MS = 1_000_000


def streaming_record() -> RequestTiming:
    # received at 0; issued at 1 ms; new connection: dns 1-2, tcp 2-4, tls 4-7; headers at 10 ms;
    # content chunks at 210, 220, 230 ms; upstream ends 231 ms; response ends 232 ms.
    t = RequestTiming(received_ns=0, endpoint="chat", model="m", stream=True)
    t.issued_ns = 1 * MS
    t.first_event_ns = 1 * MS + 500_000  # pool wait 0.5 ms
    t.tcp_start_ns = t.first_event_ns
    t.dns_start_ns, t.dns_end_ns = 1 * MS + 500_000, 2 * MS
    t.tcp_end_ns = 4 * MS
    t.tls_start_ns, t.tls_end_ns = 4 * MS, 7 * MS
    t.headers_ns = 10 * MS
    t.rtt_s = 0.001
    t.content_ns = [210 * MS, 220 * MS, 230 * MS]
    t.upstream_end_ns = 231 * MS
    t.response_end_ns = 232 * MS
    t.tokenize_prompt_s = 0.002
    t.prompt_tokens = 1000
    t.completion_tokens = 3
    return t


def test_durations_are_exact():
    b = split(streaming_record())
    assert b.e2e_s == pytest.approx(0.232, abs=1e-12)
    assert b.ttft_s == pytest.approx(0.210, abs=1e-12)
    assert b.decode_s == pytest.approx(0.020, abs=1e-12)
    assert b.decode_tokens_per_second == pytest.approx(2 / 0.020)
    assert b.connect == pytest.approx({"dns": 0.0005, "tcp": 0.002, "tls": 0.003})
    assert b.pool_wait_s == pytest.approx(0.0005)
    assert b.inter_chunk_s == pytest.approx([0.010, 0.010])
    assert b.inter_token_s == pytest.approx([0.010, 0.010])


def test_phases_follow_the_definitions_and_sum_to_the_total():
    b = split(streaming_record())
    network = 0.0005 + 0.002 + 0.003 + 0.001  # dns + tcp + tls + rtt (the pool's wait is the proxy's own: `wait`)
    assert b.phases["client"] == 0.0  # body_end_ns unset: the body came with the headers
    assert b.phases["proxy"] == pytest.approx(0.001 + 0.001)  # before upstream + after its end
    assert b.phases["wait"] == pytest.approx(0.0005)
    assert b.phases["network"] == pytest.approx(network)
    assert b.phases["tokenize"] == pytest.approx(0.002)
    assert b.phases["prefill"] == pytest.approx(0.210 - 0.001 - 0.0005 - network - 0.002)
    assert b.phases["decode"] == pytest.approx(0.231 - 0.210)
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s, abs=1e-9)
    assert b.prefill_tokens_per_second == pytest.approx(1000 / b.phases["prefill"])
    assert b.dominant == "prefill"


def test_a_long_pool_wait_is_the_proxys_own_wait_never_network():
    """25 s waiting for a free connection of a full pool (the issue's stream 1,001): the phase
    `wait`; network stays the connect and the round trip."""
    t = streaming_record()
    shift = 25_000 * MS
    t.first_event_ns += shift
    for name in ("dns_start_ns", "dns_end_ns", "tcp_start_ns", "tcp_end_ns", "tls_start_ns", "tls_end_ns", "send_start_ns", "sent_ns",
                 "headers_ns", "upstream_end_ns", "response_end_ns"):
        if getattr(t, name) is not None:
            setattr(t, name, getattr(t, name) + shift)
    t.content_ns = [c + shift for c in t.content_ns]
    b = split(t)
    assert b.phases["wait"] == pytest.approx(25.0005)
    assert b.phases["network"] == pytest.approx(0.0005 + 0.002 + 0.003 + 0.001)
    assert b.dominant == "wait"
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s, abs=1e-9)


def test_relaying_the_first_token_is_the_proxys_time_not_decode():
    t = streaming_record()
    t.first_sent_ns = 210 * MS + 300_000  # the first content chunk took 0.3 ms to hand to the client's socket
    b = split(t)
    assert b.proxy_first_s == pytest.approx(0.0003)
    assert b.phases["proxy"] == pytest.approx(0.001 + 0.0003 + 0.001)
    assert b.phases["decode"] == pytest.approx(0.231 - 0.210 - 0.0003)
    assert b.ttft_s == pytest.approx(0.210)  # TTFT stays the read of the first token
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s, abs=1e-9)


def test_first_token_relay_overlapping_the_end_is_counted_once():
    t = streaming_record()
    t.content_ns = [230 * MS]
    t.upstream_end_ns = 230 * MS  # the end came in the same read as the only token
    t.first_sent_ns = 231 * MS
    b = split(t)
    assert b.proxy_first_s == 0.0 and b.phases["decode"] == 0.0
    assert b.phases["proxy"] == pytest.approx(0.001 + 0.002)  # the rest is the time after the upstream's end
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s, abs=1e-9)


def test_reused_connection_has_no_connect_steps_and_uses_the_kernel_rtt():
    t = streaming_record()
    t.tcp_start_ns = t.tcp_end_ns = t.dns_start_ns = t.dns_end_ns = t.tls_start_ns = t.tls_end_ns = None
    assert t.reused is True
    b = split(t)
    assert b.connect == {}
    assert b.phases["network"] == pytest.approx(0.001)  # one RTT; the pool's 0.5 ms is `wait`
    assert b.phases["wait"] == pytest.approx(0.0005)


def test_rtt_falls_back_to_the_tcp_connect_time():
    t = streaming_record()
    t.rtt_s = None
    b = split(t)
    assert b.phases["network"] == pytest.approx(0.0005 + 0.002 + 0.003 + 0.002)


def test_decode_rate_needs_a_second_content_chunk_and_a_positive_window():
    t = streaming_record()
    t.content_ns = [210 * MS]
    assert split(t).decode_tokens_per_second is None
    t.content_ns = [210 * MS, 210 * MS]
    assert split(t).decode_tokens_per_second is None


def test_decode_counts_the_tokens_after_the_first_chunk_over_the_window():
    # chunks of 4, 4 and 2 tokens at a true 100 tok/s: 4 at 0, 4 more at 40 ms, 2 more at 60 ms
    t = streaming_record()
    t.content_ns = [210 * MS, 250 * MS, 270 * MS]
    t.chunk_tokens = [4.0, 4.0, 2.0]
    t.completion_tokens = 10
    b = split(t)
    assert b.decode_tokens_per_second == pytest.approx(100.0)  # (4 + 2) / 0.060, not (10 - 1) / 0.060
    assert b.inter_token_s == pytest.approx([0.010, 0.010])


def test_each_choice_is_its_own_sequence():
    # n=2, each choice at 50 tok/s, interleaved 10 ms apart
    t = streaming_record()
    t.content_ns = [210 * MS + k * 10 * MS for k in range(10)]
    t.content_choice = [k % 2 for k in range(10)]
    t.completion_tokens = 10
    b = split(t)
    assert b.choices == 2
    assert b.choice_decode_tps == pytest.approx([50.0, 50.0])
    assert b.decode_tokens_per_second == pytest.approx(50.0)
    assert b.inter_token_s == pytest.approx([0.020] * 8)
    assert b.ttft_s == pytest.approx(0.210)


def test_hidden_reasoning_is_its_own_phase_estimated_from_the_decode_rate():
    # 200 hidden tokens; visible tokens at 100 tok/s: reasoning = 2 s of a 2.5 s TTFT
    t = streaming_record()
    t.content_ns = [2500 * MS + k * 10 * MS for k in range(11)]
    t.upstream_end_ns, t.response_end_ns = 2601 * MS, 2602 * MS
    t.completion_tokens, t.reasoning_tokens = 211, 200
    b = split(t)
    assert t.hidden_reasoning_tokens == 200 and t.visible_tokens == 11
    assert b.decode_tokens_per_second == pytest.approx(100.0)
    assert b.phases["reasoning"] == pytest.approx(2.0)
    assert b.phases["prefill"] == pytest.approx(2.5 - 0.001 - b.phases["wait"] - b.phases["network"] - 0.002 - 2.0)
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s, abs=1e-9)
    t.reasoning_streamed = True  # visible reasoning stays decode: no estimate
    assert "reasoning" not in split(t).phases


def test_reasoning_is_capped_so_prefill_stays_non_negative():
    t = streaming_record()
    t.completion_tokens, t.reasoning_tokens = 100_003, 100_000
    b = split(t)
    assert b.phases["prefill"] == 0.0
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s, abs=1e-9)


def test_prefill_rate_counts_uncached_prompt_tokens_only():
    t = streaming_record()
    t.prompt_tokens, t.cached_prompt_tokens = 2000, 1900
    b = split(t)
    assert b.prefill_tokens_per_second == pytest.approx(100 / b.phases["prefill"])


def test_client_upload_is_the_client_phase_and_the_upstream_upload_is_network():
    t = streaming_record()
    t.received_ns, t.body_end_ns = -3000 * MS, 0  # the client took 3 s to send its body
    t.send_start_ns, t.sent_ns = 8 * MS, 9 * MS
    b = split(t)
    assert b.phases["client"] == pytest.approx(3.0)
    assert b.phases["proxy"] == pytest.approx(0.002)
    assert b.phases["network"] == pytest.approx(0.0005 + 0.002 + 0.003 + 0.001 + 0.001)
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s, abs=1e-9)


def test_a_request_that_never_went_upstream_is_client_and_proxy_time():
    t = RequestTiming(received_ns=0, endpoint="chat")
    t.body_end_ns, t.response_end_ns = 2 * MS, 3 * MS
    assert split(t).phases == pytest.approx({"client": 0.002, "proxy": 0.001})


def test_inter_token_latency_divides_by_tokens_in_the_later_chunk():
    t = streaming_record()
    t.chunk_tokens = [1.0, 2.0, 5.0]
    assert split(t).inter_token_s == pytest.approx([0.005, 0.002])


def test_non_streaming_server_time_is_one_phase():
    t = RequestTiming(received_ns=0, endpoint="chat", stream=False)
    t.issued_ns, t.first_event_ns, t.headers_ns = 1 * MS, 1 * MS, 500 * MS
    t.rtt_s = 0.0001
    t.upstream_end_ns, t.response_end_ns = 501 * MS, 502 * MS
    b = split(t)
    assert b.ttft_s is None and "prefill" not in b.phases and "decode" not in b.phases
    assert b.phases["server"] == pytest.approx(0.502 - 0.002 - 0.0001)
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s)


def test_network_and_tokenize_are_capped_so_prefill_is_never_negative():
    t = streaming_record()
    t.tokenize_prompt_s = 5.0  # far more than the whole TTFT
    b = split(t)
    assert b.phases["prefill"] == 0.0
    assert sum(b.phases.values()) == pytest.approx(b.e2e_s, abs=1e-9)


def test_units():
    assert NS == 1_000_000_000
