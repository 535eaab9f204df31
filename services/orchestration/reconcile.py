"""Which processes ``diloco up`` runs for the jobs of the registry: pure decision logic.

The gateway only writes records (KV ``diloco_jobs``: spec, state, unit count) and desired unit
states (KV ``diloco_desired``). About once a second ``diloco up`` reads both and asks
:func:`plan` what to do; ``services.orchestration.local.cluster`` then starts or stops the
processes. No I/O here.

Rules, for every registered job other than ``diloco up``'s own job:

* a job that is not ``stopped`` (``created``, ``running`` or ``paused``) has one outer process
  (``<job>/outer``) and one learner process (``<job>/learner-<u>``) per unit index below its unit
  count whose desired state is not ``stopped``. Learners obey their desired state themselves:
  ``idle``/``paused`` wait, ``running`` trains, ``stopped`` uploads what it has and exits 0.
* A process is started once; afterwards the restart policy (``services.orchestration.supervisor``)
  decides: a learner that exited 0 (stopped or finished its steps) stays down, a crashed one comes
  back. Scaling up therefore starts learners for the new indexes only; scaling down needs no action
  (the gateway sets the removed units to ``stopped`` and they exit by themselves).
* A job that is ``stopped`` or deleted gets nothing new. Once none of its learners runs any more
  (each finished or was left dead), its outer is retired: SIGTERM, and not restarted.

How a spec becomes flags: the spec holds the same settings models as the services (workload,
algorithm, codec; ``shared.settings``), so every option of a service that the spec holds is
passed on as it is (``shared.settings.cli.flags_for``), plus, per process:

* to learners: ``--unit <u>``, ``--num-units <units>``, ``--max-steps`` and
  ``--checkpoint-dir <data-dir>/units``; to the outer: ``--num-units <units>`` and
  ``--learner-steps``, the learners' ``--max-steps`` (peer review follows their learning rate);
* ``units`` is the job's *current* unit count when the process starts (a running outer keeps the
  count it started with; it only weights participation and the Delayed Nesterov period);
* ``max_steps`` goes to learners as it is; ``token_budget`` becomes
  ``max_steps = ceil(token_budget / (units · batch_size · seq_len))`` with the spec's batch size
  and the model's context length, ``units`` again the count when the learner starts.

Options that are not the job's (threads, status intervals, timeouts) keep the service's default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Literal

from services.learner.settings import LearnerSettings
from services.orchestration.commands import LEARNER_OWN, OUTER_OWN
from services.orchestration.supervisor import State
from services.outer.settings import OuterSettings
from shared.records.jobs import FINAL_DESIRED, JobRecord, JobSpec
from shared.settings.cli import flags_for

DONE = (State.FINISHED, State.GAVE_UP)


def outer_name(job: str) -> str:
    """The child name (pids.json, restarts) of a registry job's outer."""
    return f"{job}/outer"


def learner_name(job: str, unit: int) -> str:
    """The child name of a registry job's learner for ``unit``."""
    return f"{job}/learner-{unit}"


def job_of(name: str) -> str | None:
    """The job of a child name made by :func:`outer_name` or :func:`learner_name`."""
    return name.split("/", 1)[0] if "/" in name else None


def is_outer(name: str) -> bool:
    """Whether ``name`` is the child name of a registry job's outer."""
    job = job_of(name)
    return job is not None and name == outer_name(job)


def unit_max_steps(spec: JobSpec, units: int) -> int:
    """Inner steps of each learner: ``max_steps``, or the token budget shared by ``units``
    learners of the spec's batch size and the model's context length."""
    if spec.token_budget is None:
        assert spec.max_steps is not None  # the spec's validator sets one of the two
        return spec.max_steps
    return max(1, math.ceil(spec.token_budget / (units * spec.tokens_per_step())))


def learner_args(record: JobRecord, unit: int, checkpoint_dir: str) -> list[str]:
    """``diloco learner`` arguments (without ``--nats-url``) of one unit of a registry job."""
    spec = record.spec
    return [
        "learner",
        *flags_for(spec, LearnerSettings, LEARNER_OWN),
        "--unit",
        str(unit),
        "--num-units",
        str(record.units),
        "--max-steps",
        str(unit_max_steps(spec, record.units)),
        "--checkpoint-dir",
        checkpoint_dir,
        # One device per unit: the job's batch size is what its outer expects per step.
        "--devices",
        "1",
    ]


def outer_args(record: JobRecord) -> list[str]:
    """``diloco outer`` arguments (without ``--nats-url``) of a registry job."""
    return [
        "outer",
        *flags_for(record.spec, OuterSettings, OUTER_OWN),
        "--num-units",
        str(record.units),
        "--learner-steps",
        str(unit_max_steps(record.spec, record.units)),
    ]


@dataclass(frozen=True)
class Spawn:
    """Start a process for a job: ``args`` is the ``diloco`` command line to complete."""

    name: str
    job: str
    role: Literal["outer", "learner"]
    args: tuple[str, ...]
    unit: int | None = None  # a learner's unit


@dataclass(frozen=True)
class Retire:
    """Stop a stopped or deleted job's outer for good (its learners are all done)."""

    name: str
    job: str


Action = Spawn | Retire


def plan(
    records: Mapping[str, JobRecord],
    desired: Mapping[str, Mapping[int, str]],
    children: Mapping[str, State],
    retiring: Set[str],
    *,
    own_job: str,
    checkpoint_dir: str,
) -> list[Action]:
    """What to start and stop so that the processes match the registry.

    Args:
        records: the registry's jobs by name (deleted jobs are absent).
        desired: each job's desired unit states by unit index (a missing one means running).
        children: the state of every job process ever started, by child name.
        retiring: child names already retired (not to be retired again).
        own_job: ``diloco up``'s own job, which this never touches.
        checkpoint_dir: the learners' ``--checkpoint-dir``.
    """
    actions: list[Action] = []
    jobs = sorted(
        {name for name in records if name != own_job}
        | {job for name in children if (job := job_of(name)) and job != own_job}
    )
    for job in jobs:
        record = records.get(job)
        if record is not None and record.state != "stopped":
            if outer_name(job) not in children:
                actions.append(Spawn(outer_name(job), job, "outer", tuple(outer_args(record))))
            states = desired.get(job, {})
            for unit in range(record.units):
                name = learner_name(job, unit)
                if name not in children and states.get(unit, "running") not in FINAL_DESIRED:
                    args = learner_args(record, unit, checkpoint_dir)
                    actions.append(Spawn(name, job, "learner", tuple(args), unit))
            continue
        # Stopped or deleted: the learners exit by themselves; then the outer goes.
        outer = outer_name(job)
        learners_done = all(
            state in DONE
            for name, state in children.items()
            if job_of(name) == job and name != outer
        )
        outer_runs = outer in children and children[outer] not in DONE
        if learners_done and outer_runs and outer not in retiring:
            actions.append(Retire(outer, job))
    return actions


def active_children(children: Mapping[str, State]) -> list[str]:
    """Job processes that run or will be restarted (not finished, not left dead)."""
    return [name for name, state in children.items() if state not in DONE]
