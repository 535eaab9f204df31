"""`--mode sync` (synchronous DiLoCo) with real processes: three units train, one is killed with
SIGKILL; the others wait at their sync points, the outer drops the dead unit from the round after
the timeout, and training goes on. (Under the decoupled default nothing waits for a killed unit:
``tests/test_faults.py::test_killed_unit_does_not_stop_the_others_and_rejoins_within_30s``.)"""

from __future__ import annotations

import signal
import time

import pytest

from tests.helpers import read_status, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

TIMEOUT_S = 6.0  # --sync-timeout-s
WATCH_S = 12.0  # how long versions are watched after the kill


@pytest.mark.timeout(300)
def test_a_killed_unit_holds_a_sync_round_up_to_the_timeout_then_training_goes_on(
    nats_server, services
):
    job = "mode-sync"
    flags = [
        *("--nats-url", nats_server.url, "--job", job, "--model", "tiny", "--seed", "1"),
        *("--mode", "sync", "--sync-timeout-s", str(TIMEOUT_S)),
    ]
    services.start("outer", "outer", *flags, "--num-units", "3", "--eval-every-s", "60")
    wait_for(
        lambda: (
            (outer := read_status(nats_server.url, job)[0]) is not None and outer.state == "running"
        ),
        120,
        "the outer to run",
    )
    learners = [
        services.start(
            f"learner-{unit}",
            "learner",
            *flags,
            *("--unit", str(unit), "--num-units", "3", "--max-steps", "100000"),
            *("--h-steps", "10", "--no-dynamic-h", "--slowdown", "3"),
        )
        for unit in range(3)
    ]

    def every_unit_applied_twice():
        outer = read_status(nats_server.url, job)[0]
        ledger = outer.units if outer is not None else {}
        return all(unit in ledger and ledger[unit].applied >= 2 for unit in range(3))

    wait_for(every_unit_applied_twice, 180, "two rounds of every unit applied")
    before = read_status(nats_server.url, job)[0]
    assert before is not None
    learners[2].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    version = None
    changes = [killed_at]  # when the outer's version changed, from the kill on
    while time.monotonic() - killed_at < WATCH_S:
        outer = read_status(nats_server.url, job)[0]
        assert outer is not None
        if version is not None and outer.version != version:
            changes.append(time.monotonic())
        version = outer.version
        time.sleep(0.1)
    changes.append(time.monotonic())
    longest = max(b - a for a, b in zip(changes[:-1], changes[1:], strict=True))
    outer, units = read_status(nats_server.url, job)
    assert outer is not None
    # Training went on without unit 2: a round was merged without it, and the survivors'
    # uploads kept being applied. (Until unit 2 has been silent for three upload intervals,
    # each round waits for it up to the timeout.)
    assert len(changes) >= 3, changes
    assert all(outer.units[unit].applied > before.units[unit].applied for unit in (0, 1)), (
        outer.units
    )
    # A round waited for the dead unit, up to the timeout; the survivors waited with it.
    assert longest >= 0.7 * TIMEOUT_S, (longest, changes)
    assert all(units[unit].sync_wait_s > 0 for unit in (0, 1))
    assert outer.rejected.keys() <= {"incomplete_upload"}, outer.rejected  # the killed upload
