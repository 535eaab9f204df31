"""Two learners and the outer, as separate processes over a real nats-server, really train."""

from __future__ import annotations

import pytest

from tests.conftest import read_status, wait_for

JOB = "e2e"


@pytest.mark.timeout(400)
def test_two_learners_and_outer_advance_version_and_lower_eval_loss(nats_server, services):
    job_flags = ["--nats-url", nats_server.url, "--job", JOB, "--model", "tiny", "--seed", "1"]
    services.start("outer", "outer", *job_flags, "--eval-every-s", "2")
    learners = [
        services.start(
            f"learner-{unit}",
            "learner",
            *job_flags,
            "--unit",
            str(unit),
            "--num-units",
            "2",
            "--max-steps",
            "150",
            "--h-steps",
            "10",
            "--batch-size",
            "16",
        )
        for unit in range(2)
    ]
    for learner in learners:
        try:
            assert learner.wait(timeout=300) == 0, services.logs()
        except Exception:
            print(services.logs())
            raise

    def outer_caught_up():
        outer, units = read_status(nats_server.url, JOB)
        published = sum(u["counters"].get("published", 0) for u in units.values())
        if outer and outer["applied"] >= published and outer["eval"]["version"] == outer["version"]:
            return outer, units
        return None

    outer, units = wait_for(outer_caught_up, 120, "the outer to apply and evaluate every upload")
    assert set(units) == {0, 1}
    # 150 steps at H=10 -> 15 uploads per unit, every one applied once, none rejected.
    assert [units[u]["counters"]["published"] for u in (0, 1)] == [15, 15]
    assert outer["applied"] == 30 and outer["version"] == 30
    assert outer["rejected"] == {}
    assert {u: s["applied"] for u, s in outer["units"].items()} == {"0": 15, "1": 15}
    init_loss = outer["eval_init"]["nats_per_byte"]
    final_loss = outer["eval"]["nats_per_byte"]
    assert init_loss == pytest.approx(5.55, abs=0.15)
    assert final_loss < init_loss - 1.0, (init_loss, final_loss)
