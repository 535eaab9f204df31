"""How ``diloco up`` matches the registry's jobs with processes
(``services.orchestration.reconcile``), the retirement of a child in
``services.orchestration.supervisor``, and ``Cluster.reconcile`` acting on it with stand-in
children. No NATS, no JAX."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.learner.settings import LearnerSettings
from services.orchestration import reconcile
from services.orchestration.local import files
from services.orchestration.local.cluster import Cluster
from services.orchestration.local.settings import UpSettings
from services.orchestration.reconcile import Retire, Spawn, plan
from services.orchestration.registry import Registry
from services.orchestration.supervisor import RestartPolicy, State, Supervisor
from services.outer.settings import OuterSettings
from shared import nats_auth
from shared.records.jobs import JobRecord, JobSpec
from tests.helpers import service_settings

CKPT = "/data/units"


def record(job: str = "j", state: str = "running", units: int = 2, **spec: object) -> JobRecord:
    return JobRecord(
        spec=JobSpec(job=job, model="tiny", units=units, **spec),  # type: ignore[arg-type]
        state=state,  # type: ignore[arg-type]
        units=units,
        created=0.0,
        updated=0.0,
    )


def names(actions: list) -> list[str]:
    return [a.name for a in actions]


def test_every_spec_field_reaches_a_service_or_is_handled_explicitly():
    services = set(LearnerSettings.model_fields) | set(OuterSettings.model_fields)
    assert set(JobSpec.model_fields) - services == {"units", "token_budget"}


def test_spec_becomes_learner_and_outer_flags():
    job = record(units=3, h_steps=7, codec="int4", outer_lr=0.5, max_steps=40)
    learner_argv = reconcile.learner_args(job, 2, CKPT)
    assert learner_argv[0] == "learner"
    assert "--outer-lr" not in learner_argv  # the outer's, not the learner's
    learner = service_settings(LearnerSettings, learner_argv)
    assert (learner.job, learner.model, learner.h_steps, learner.codec) == ("j", "tiny", 7, "int4")
    assert (learner.unit, learner.num_units, learner.max_steps) == (2, 3, 40)
    assert learner.checkpoint_dir == CKPT
    outer_argv = reconcile.outer_args(job)
    assert outer_argv[0] == "outer"
    assert "--max-staleness" not in outer_argv  # None: left out
    outer = service_settings(OuterSettings, outer_argv)
    assert (outer.outer_lr, outer.num_units) == (0.5, 3)
    # The bounds on one upload's work: the job's H, batch, learning rate and weight decay.
    assert (outer.h_steps, outer.batch_size) == (7, job.spec.batch_size)
    assert (outer.inner_lr, outer.weight_decay) == (job.spec.inner_lr, job.spec.weight_decay)


def test_token_budget_is_shared_by_the_units_as_max_steps():
    # tiny: seq_len 64; default batch size 16: one step of 2 units = 2048 tokens.
    assert reconcile.unit_max_steps(record(token_budget=2048 * 10).spec, 2) == 10
    assert reconcile.unit_max_steps(record(token_budget=2048 * 10 + 1).spec, 2) == 11
    assert reconcile.unit_max_steps(record(token_budget=5).spec, 2) == 1
    assert reconcile.unit_max_steps(record(max_steps=9).spec, 2) == 9


def test_a_new_job_gets_an_outer_and_one_learner_per_unit_not_stopped():
    actions = plan(
        {"j": record(state="created", units=3), "own": record("own")},
        {"j": {0: "idle", 1: "stopped"}},
        {},
        set(),
        own_job="own",
        checkpoint_dir=CKPT,
    )
    assert names(actions) == ["j/outer", "j/learner-0", "j/learner-2"]  # 2: no desired = running
    assert all(isinstance(a, Spawn) for a in actions)
    assert actions[1].role == "learner" and "--unit" in actions[1].args


def test_started_processes_are_left_to_the_restart_policy_and_scaling_up_adds_learners():
    running = {
        "j/outer": State.RUNNING,
        "j/learner-0": State.FINISHED,
        "j/learner-1": State.WAITING,
    }
    kwargs = {"own_job": "own", "checkpoint_dir": CKPT}
    assert plan({"j": record(units=2)}, {}, running, set(), **kwargs) == []
    actions = plan({"j": record(units=4)}, {"j": {3: "paused"}}, running, set(), **kwargs)
    assert names(actions) == ["j/learner-2", "j/learner-3"]
    assert actions[0].args[actions[0].args.index("--num-units") + 1] == "4"


def test_a_stopped_or_deleted_job_retires_its_outer_once_its_learners_are_done():
    kwargs = {"own_job": "own", "checkpoint_dir": CKPT}
    children = {"j/outer": State.RUNNING, "j/learner-0": State.RUNNING}
    for records in ({"j": record(state="stopped")}, {}):
        assert plan(records, {}, children, set(), **kwargs) == []
        done = {**children, "j/learner-0": State.FINISHED}
        assert plan(records, {}, done, set(), **kwargs) == [Retire("j/outer", "j")]
        assert plan(records, {}, done, {"j/outer"}, **kwargs) == []
        gone = {**done, "j/outer": State.FINISHED}
        assert plan(records, {}, gone, set(), **kwargs) == []


def test_own_job_is_never_touched():
    children = {"own/outer": State.RUNNING}
    assert (
        plan({"own": record("own")}, {}, children, set(), own_job="own", checkpoint_dir=CKPT) == []
    )
    assert plan({}, {}, children, set(), own_job="own", checkpoint_dir=CKPT) == []


def test_a_retired_child_is_done_whatever_its_exit_code_and_a_pending_restart_is_cancelled():
    supervisor = Supervisor()
    supervisor.add("j/outer", 0.0)
    supervisor.retire("j/outer")
    assert supervisor.exited("j/outer", -15, 1.0).state is State.FINISHED
    supervisor.add("k/outer", 0.0)
    assert supervisor.exited("k/outer", 1, 1.0).state is State.WAITING
    supervisor.retire("k/outer")
    assert supervisor.state("k/outer") is State.FINISHED and supervisor.due(1e9) == []
    assert supervisor.retired() == {"j/outer", "k/outer"}


# --- Cluster.reconcile with stand-in children ---------------------------------------------------


def _sleeper(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log_file:
        script = "import time; time.sleep(60)"
        return subprocess.Popen([sys.executable, "-c", script], stdout=log_file)


@pytest.fixture
def stand_in_cluster(tmp_path: Path):
    settings = UpSettings(learners=1, data_dir=str(tmp_path))
    cluster = Cluster(settings, out=io.StringIO(), launch=_sleeper)
    cluster.supervisor = Supervisor(RestartPolicy(initial_backoff_s=0.05))
    reloads: list[str] = []
    server = SimpleNamespace(
        url="nats://127.0.0.1:1",
        alive=lambda: False,
        stop=lambda: None,
        reload=reloads.append,
        reloads=reloads,
    )
    cluster.servers = [server]  # type: ignore[list-item]
    yield cluster
    cluster.stop()


def test_cluster_starts_a_jobs_processes_and_stops_its_outer_after_its_learners(
    stand_in_cluster, tmp_path
):
    cluster = stand_in_cluster
    cluster.reconcile(Registry({"j": record(units=2)}, {"j": {0: "running", 1: "running"}}))
    pids = files.read_pids(tmp_path)
    assert pids is not None and set(pids.pids) == {"j/outer", "j/learner-0", "j/learner-1"}
    assert (Path(cluster.settings.data_dir) / "logs" / "j-learner-1.log").exists()
    learner = next(c for c in cluster.job_children if c.name == "j/learner-1")
    assert "--nats-url" in learner.args and learner.args[0] == "learner"
    # The job's NATS users were added to the server in one reload; each process got its own.
    [authorization] = cluster.servers[0].reloads
    assert '"learner-j-1"' in authorization and '"outer-j"' in authorization
    credentials = nats_auth.read_credentials(learner.env["DILOCO_NATS_CREDENTIALS"])
    assert (credentials.user, credentials.role) == ("learner-j-1", "learner")
    assert cluster.jobs_busy()
    # Stopped: the learners exit 0 by themselves (here: terminated, reported as exit 0 ...).
    for child in cluster.job_learners():
        child.process.kill()
        child.process.wait()
        cluster.supervisor.exited(child.name, 0, time.monotonic())
    cluster.reconcile(Registry({"j": record(state="stopped")}))
    assert "job j: its learners are done, stopping j/outer" in cluster.out.getvalue()
    outer = cluster.job_outers()[0]
    outer.process.wait(timeout=10)
    cluster.heal(lambda: False)
    assert cluster.supervisor.state("j/outer") is State.FINISHED  # SIGTERM: not restarted
    assert not cluster.jobs_busy()
    pids = files.read_pids(tmp_path)
    assert pids is not None and pids.pids == {}
