"""A replica's health (proxy/fleet/health.py): set aside while it fails, back after one probe; on an injected clock."""
import email.utils

import pytest

from proxy.fleet.health import EJECTED, PROBING, SERVING, EjectionSpec, Health, retry_after_s


def test_consecutive_failures_eject_for_the_base_time_then_one_probe_decides():
    told = []
    h = Health(EjectionSpec(consecutive=5, base_s=30, max_s=300), lambda reason, seconds: told.append((reason, seconds)))
    now = 100.0
    for i in range(4):
        h.sent(now)
        assert h.failed(now) == "" and h.available(now)
    h.sent(now)
    assert h.failed(now) == "consecutive_failures" and h.state == EJECTED and told == [("consecutive_failures", 30.0)]
    assert not h.available(now + 29.9) and not h.due(now + 29.9)
    assert h.due(now + 30) and h.available(now + 30)
    assert h.sent(now + 30) is True and h.state == PROBING  # the next request is the probe
    assert not h.available(now + 30.1)  # nothing else goes to it while the probe is out
    h.failed(now + 31, probe=True)  # the probe failed too: set aside again, twice as long
    assert h.state == EJECTED and h.reason == "probe_failed" and told[-1] == ("probe_failed", 60.0)
    assert not h.available(now + 31 + 59.9) and h.sent(now + 91) is True
    h.succeeded(now + 91.5, probe=True)
    assert h.state == SERVING and h.available(now + 91.5) and h.consecutive == 0


def test_ejection_time_grows_on_repeats_up_to_the_cap_and_shrinks_after_serving_well():
    h = Health(EjectionSpec(consecutive=1, base_s=30, max_s=70))
    now = 0.0
    for expected in (30, 60, 70, 70):  # base x times in a row, at most max_time
        h.sent(now)
        h.failed(now, probe=h.state == PROBING)
        assert h.until - now == expected
        now = h.until
        assert h.sent(now)  # the probe
    h.succeeded(now, probe=True)
    now += 3 * 30  # three base times served well: the multiplier falls by three (4 -> 1), then this ejection adds one
    h.sent(now)
    h.failed(now)
    assert h.until - now == 60


def test_a_failure_share_ejects_a_replica_that_fails_often_but_never_five_times_in_a_row():
    h = Health(EjectionSpec(consecutive=5, share=0.5, min_requests=10, window_s=10))
    now = 50.0
    for i in range(20):
        h.sent(now)
        if i % 3 == 2:
            h.succeeded(now)
        elif h.failed(now):
            break
        now += 0.1
    assert h.state == EJECTED and h.reason == "failure_share" and i >= 9
    quiet = Health(EjectionSpec(share=0.5, min_requests=10))
    for _ in range(4):
        quiet.sent(0.0)
        quiet.failed(0.0)
        quiet.sent(0.0)
        quiet.succeeded(0.0)
    assert quiet.state == SERVING  # (8 attempts: under min_requests)
    assert quiet.share(0.0) == pytest.approx(4 / 9)  # (one success assumed)
    assert quiet.share(20.0) == 0.0  # the window has moved past them


def test_retry_after_sets_it_aside_for_that_long_capped_and_never_shortens_an_ejection():
    h = Health(EjectionSpec(retry_after_max_s=60))
    h.sent(0.0)
    assert h.failed(0.0, retry_after=5) == "retry_after" and h.until == 5 and h.multiplier == 0
    h.failed(1.0, retry_after=2)  # a request sent before asks for less: the quiet stays 5 s
    assert h.until == 5
    h.failed(1.0, retry_after=3600)
    assert h.until == 61  # capped
    off = Health(EjectionSpec(enabled=False))
    for _ in range(20):
        off.sent(0.0)
        assert off.failed(0.0, retry_after=5) == "" and off.state == SERVING


def test_an_attempt_that_says_nothing_passes_the_probe_on():
    h = Health(EjectionSpec(consecutive=1, base_s=10))
    h.sent(0.0)
    h.failed(0.0)
    assert h.sent(10.0) and not h.available(10.0)
    h.ended(probe=True)  # the client left before the probe's verdict
    assert h.state == EJECTED and h.due(10.0) and h.sent(10.0)
    h.failed(10.5, retry_after=30)  # a request sent before the probe asks for quiet: the probe's success does not cut it short
    h.succeeded(11.0, probe=True)
    assert h.state == EJECTED and h.until == 40.5


def test_retry_after_is_read_in_seconds_milliseconds_or_as_a_date():
    assert retry_after_s([(b"Retry-After", b"5")]) == 5.0
    assert retry_after_s([(b"retry-after-ms", b"1500"), (b"retry-after", b"9")]) == 1.5
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert retry_after_s([(b"retry-after", date.encode())], now_wall=1_000_000.0) == 30.0
    assert retry_after_s([(b"retry-after", b"soon")]) is None and retry_after_s([]) is None


@pytest.mark.parametrize("spec, words", [({"consecutive_failures": 0}, "whole number"), ({"failure_share": 1.5}, "share"),
                                         ({"base_time": "30s"}, "seconds"), ({"cooldown": 5}, "ejection must be"), ("sometimes", "ejection must be")])
def test_a_broken_ejection_policy_is_refused_with_its_line(spec, words):
    with pytest.raises(ValueError) as error:
        EjectionSpec.parse(spec, "routes file r.yaml, line 3")
    assert "line 3" in str(error.value) and words in str(error.value)
    assert EjectionSpec.parse("off", "x").enabled is False and EjectionSpec.parse({"base_time": 5}, "x").base_s == 5.0


def test_busy_answers_weigh_on_the_score_and_never_eject():
    """A 429 or a missed deadline, however many in a row: counted in the share a score divides by, never an ejection."""
    h = Health(EjectionSpec(consecutive=2, min_requests=2))
    for i in range(20):
        h.sent(100.0 + i * 0.1)
        h.busy(100.0 + i * 0.1)
    assert h.state == SERVING and h.available(102.0) and h.share(102.0) == pytest.approx(20 / 21)
    h.busy(102.0, backoff=5.0)  # a 429 on the proxy's own key: a back-off, not an ejection
    assert h.state == SERVING and h.backing_off(106.9) and not h.backing_off(107.1)


def test_active_checks_set_a_replica_aside_and_bring_it_back_never_a_user_request():
    told = []
    h = Health(EjectionSpec(), lambda reason, seconds: told.append(reason))
    h.checked = True
    assert h.check(100.0, False, unhealthy=2) == "" and h.state == SERVING  # one failed check is no verdict
    assert h.check(101.0, False, unhealthy=2) == "health_check" and h.state == EJECTED and told == ["health_check"]
    assert not h.available(500.0) and not h.due(500.0)  # with checks, no request is its probe
    h.check(102.0, True, unhealthy=2)
    assert h.state == SERVING and h.alive_s == 102.0
    for i in range(5):  # failing requests: set aside for the base time; a passing check before it is up does not end it
        h.sent(103.0)
        h.failed(103.0)
    assert h.state == EJECTED and h.reason == "consecutive_failures"
    h.check(110.0, True, unhealthy=2)
    assert h.state == EJECTED
    h.check(133.5, True, unhealthy=2)
    assert h.state == SERVING


def test_a_replica_serving_by_force_comes_back_at_its_first_success():
    h = Health(EjectionSpec(consecutive=1))
    h.sent(100.0)
    h.failed(100.0)
    assert h.state == EJECTED
    h.succeeded(101.0, forced=False)  # (a request sent before it was set aside says nothing now)
    assert h.state == EJECTED
    h.succeeded(101.0, forced=True)  # the route served it by force (panic mode), and it served
    assert h.state == SERVING


@pytest.mark.parametrize("spec, words", [({"interval": 0}, "interval must be"), ({"path": "health"}, "must start with /"),
                                         ({"unhealthy": 0}, "unhealthy must be"), ({"generate": "yes"}, "true or false"),
                                         ({"every": 1}, "health_check must be `off` or a map"), ({"metrics": "metrics"}, "metrics must be")])
def test_a_broken_health_check_policy_is_refused_with_its_line(spec, words):
    from proxy.fleet.checks import CheckSpec

    with pytest.raises(ValueError) as error:
        CheckSpec.parse(spec, "routes file r.yaml, line 9")
    assert "line 9" in str(error.value) and words in str(error.value)
    assert CheckSpec.parse("off", "x").enabled is False and CheckSpec.parse(None, "x") == CheckSpec()
