"""`--mode sync` (synchronous DiLoCo) with real processes: three units train, one is killed with
SIGKILL; the others wait at their sync points, the outer drops the dead unit from the round after
the timeout (on the policy's clock: tests/test_outer_core.py; on the wall clock: bench/timing.py),
and training goes on. (Under the decoupled default nothing waits for a killed unit:
``tests/test_faults.py::test_killed_unit_does_not_stop_the_others_and_rejoins_within_30s``.)"""

from __future__ import annotations

import signal

import pytest

from shared.settings.algorithm import SyncSettings
from tests.helpers import read_status, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

TIMEOUT_S = 6.0  # --sync-timeout-s
#: Each round uploads every fragment: the outer's ledger counts one application per fragment.
FRAGMENTS = SyncSettings().fragments


@pytest.mark.timeout(300)
def test_sync_rounds_go_on_without_a_killed_unit(nats_server, services):
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
        return all(unit in ledger and ledger[unit].applied >= 2 * FRAGMENTS for unit in range(3))

    wait_for(every_unit_applied_twice, 180, "two rounds of every unit applied")
    before = read_status(nats_server.url, job)[0]
    assert before is not None
    # Rounds combine the units' uploads: fewer merges than uploads applied.
    assert before.merges < before.applied, before
    learners[2].send_signal(signal.SIGKILL)

    def went_on_without_unit_2():
        # Two more rounds of each survivor: unit 2's last upload may ride the round under way
        # at the kill, so the second is one merged without it. The survivors report their
        # status at most every half status interval, and not while they wait at a sync point:
        # wait for reports that show their waits.
        outer, units = read_status(nats_server.url, job)
        assert outer is not None
        ledger, two_more = outer.units, 2 * FRAGMENTS
        survivors = all(ledger[u].applied >= before.units[u].applied + two_more for u in (0, 1))
        reported = all(u in units and units[u].sync_wait_s > 0 for u in (0, 1))
        return (outer, units) if survivors and reported else None

    outer, units = wait_for(went_on_without_unit_2, 120, "two more rounds of the survivors merged")
    # Training went on without unit 2: rounds were merged without it, and the survivors, which
    # wait at every sync point for the round's global, got it every time (none gave up).
    # How long a round waits for a silent unit is the merge policy's, asserted on its clock in
    # tests/test_outer_core.py; bench/timing.py measures it here, on the wall clock.
    for unit in (0, 1):
        assert units[unit].counter("sync_waits_abandoned") == 0, units[unit]
    assert outer.rejected.keys() <= {"incomplete_upload"}, outer.rejected  # the killed upload
