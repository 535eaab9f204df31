"""``shared.transport.pace``: a publish's timeout allows for the link its connection has shown."""

from __future__ import annotations

from shared.transport.pace import MIN_SAMPLE_BYTES, SAMPLES, AckPace, pace_of

FLOOR = 1e6


def test_the_slowest_link_is_assumed_until_enough_large_acks_were_measured() -> None:
    pace = AckPace(FLOOR)
    for _ in range(SAMPLES - 1):
        pace.observe(1 << 20, 0.01)  # 1 MiB in 10 ms: about 840 Mbit/s
    assert pace.bits_per_s() == FLOOR
    pace.observe(MIN_SAMPLE_BYTES - 1, 1e-6)  # a small publish measures the round trip only
    assert pace.bits_per_s() == FLOOR
    pace.observe(1 << 20, 0.01)
    assert 800e6 < pace.bits_per_s() < 900e6


def test_one_slow_ack_brings_the_estimate_down_until_it_has_passed() -> None:
    pace = AckPace(FLOOR)
    for _ in range(SAMPLES):
        pace.observe(1 << 20, 0.01)
    pace.observe(1 << 20, 2.0)  # a stall: about 4 Mbit/s
    assert 4e6 < pace.bits_per_s() < 5e6
    pace.observe(1 << 20, 100.0)  # slower than the floor: the floor holds
    assert pace.bits_per_s() == FLOOR
    for _ in range(SAMPLES):
        pace.observe(1 << 20, 0.01)
    assert pace.bits_per_s() > 800e6


class _Js:
    """Stands for nats-py's JetStream context, which keeps its connection in ``_nc``."""

    def __init__(self, connection: object) -> None:
        self._nc = connection


def test_each_connection_has_its_own_pace_shared_by_its_contexts() -> None:
    class Connection:
        pass

    one, other = Connection(), Connection()
    assert pace_of(_Js(one), FLOOR) is pace_of(_Js(one), FLOOR)
    assert pace_of(_Js(one), FLOOR) is not pace_of(_Js(other), FLOOR)
