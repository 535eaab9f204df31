"""`diloco up` runs the jobs created through the gateway: it starts an outer and one learner per
unit, adds learners when the job is scaled up, and once the job is stopped lets its learners exit
and stops its outer — next to its own job, and leaving no process behind."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.helpers import cluster_processes, live_pids, start_up, up_gateway, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

JOB = "side"
SPEC = {"job": JOB, "model": "tiny", "units": 2, "h_steps": 10, "max_steps": 3000, "seed": 1}


def job_names(data_dir: Path) -> set[str]:
    """Live processes of the registry job, by child name, from pids.json."""
    return {name for name in live_pids(data_dir) if name.startswith(f"{JOB}/")}


@pytest.mark.timeout(300)
def test_up_runs_scales_and_stops_a_job_created_through_the_gateway(tmp_path, jax_cache):
    # Its own job: one paced learner that trains for longer than this test lasts. The registry
    # job's learners are paced too (DILOCO_SLOWDOWN, inherited): they only need to keep running.
    process, data_dir, out_path = start_up(
        tmp_path,
        jax_cache,
        *("--learners", "1", "--max-steps", "100000", "--slowdowns", "5"),
        env={"DILOCO_SLOWDOWN": "4"},
    )
    try:
        client = up_gateway(data_dir, out_path)
        assert client.post("/jobs", json=SPEC).status_code == 201
        # Created: its processes start, the units idle.
        wait_for(
            lambda: job_names(data_dir) == {f"{JOB}/outer", f"{JOB}/learner-0", f"{JOB}/learner-1"},
            30,
            "the job's outer and two learners",
        )
        assert client.post(f"/jobs/{JOB}/start").status_code == 200
        seen_running: set[int] = set()

        def trains(units: range, applied: int) -> bool:
            view = client.get(f"/jobs/{JOB}").json()
            for unit in view["units"]:
                if unit["state"] == "running" and (unit["step"] or 0) > 0:
                    seen_running.add(unit["unit"])
            return set(units) <= seen_running and view["applied"] >= applied

        wait_for(lambda: trains(range(2), 1), 150, "both units training and uploads applied")
        scaled = client.put(f"/jobs/{JOB}/units", json={"units": 3})
        assert scaled.status_code == 200 and scaled.json()["units"] == 3
        wait_for(lambda: trains(range(3), 1), 120, "unit 2 training")
        pids = live_pids(data_dir)
        assert f"{JOB}/learner-2" in pids and f"{JOB}/outer" in pids
        assert client.post(f"/jobs/{JOB}/stop").status_code == 200
        wait_for(lambda: not job_names(data_dir), 90, "the job's processes to exit")
        output = out_path.read_text()
        assert f"job {JOB}: its learners are done, stopping {JOB}/outer" in output, output
        assert f"{JOB}/outer exited with code" in output, output
        assert "restart #" not in output, output  # neither the learners nor the outer came back
        assert (data_dir / "logs" / f"{JOB}-learner-2.log").exists()
        # The own job still runs; the cluster stops cleanly.
        assert {"outer", "learner-0", "gateway"} <= set(live_pids(data_dir))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0, out_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    assert "all services stopped" in out_path.read_text()
    assert cluster_processes(data_dir, out_path) == []
