"""The command lines and environments of the services of ``diloco up``'s own job.

Every service gets the same ``diloco <service>`` command line that docker-compose runs: the NATS
URL and every option of the service that ``UpSettings`` holds (the same settings models: job,
workload, algorithm, codec, resources), plus what differs per process. The learners of registry jobs
get theirs from ``services.orchestration.reconcile``.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.learner.settings import LearnerSettings
from services.orchestration.local.settings import UpSettings
from services.outer.settings import OuterSettings
from shared.link_spec import LinkSpec
from shared.settings.cli import flags_for

#: Options a launcher sets per process instead of passing them on as they are.
LEARNER_OWN = frozenset(
    {"unit", "num_units", "max_steps", "slowdown", "checkpoint_dir", "adversary"}
)
OUTER_OWN = frozenset({"num_units", "learner_steps", "shard", "shards"})

JAX_CACHE_DIR = "jax-cache"
UNITS_DIR = "units"
LOGS_DIR = "logs"


def checkpoint_dir(settings: UpSettings) -> Path:
    """Where learners checkpoint, so that a restarted one goes on where it was."""
    return (Path(settings.data_dir) / UNITS_DIR).resolve()


def logs_dir(settings: UpSettings) -> Path:
    """The folder of the children's logs."""
    return Path(settings.data_dir) / LOGS_DIR


def cache_env(settings: UpSettings) -> dict[str, str]:
    """Environment of every JAX service: the shared compilation cache, ``$DILOCO_JAX_CACHE``
    where it is set (one cache for many runs, e.g. the tests' and the benchmarks'), else the
    data folder's ``jax-cache``."""
    cache = os.environ.get("DILOCO_JAX_CACHE") or Path(settings.data_dir) / JAX_CACHE_DIR
    return {"DILOCO_JAX_CACHE": str(Path(cache).resolve())}


def threads_env(threads: int) -> dict[str, str]:
    """Environment that bounds a JAX process's compute threads (several share few cores):
    XLA's multi-threaded Eigen only with more than one thread."""
    eigen = "true" if threads > 1 else "false"
    return {"XLA_FLAGS": f"--xla_cpu_multi_thread_eigen={eigen}", "OMP_NUM_THREADS": str(threads)}


def learner_env(settings: UpSettings) -> dict[str, str]:
    """Environment of a learner: the cache and bounded XLA threads."""
    return {**cache_env(settings), **threads_env(settings.learner_threads)}


def outer_args(settings: UpSettings, nats_url: str, shard: int = 0) -> list[str]:
    """``diloco outer`` arguments of the job's outer shard ``shard``."""
    return [
        "outer",
        "--nats-url",
        nats_url,
        *flags_for(settings, OuterSettings, OUTER_OWN),
        "--num-units",
        str(settings.learners),
        "--learner-steps",
        ",".join(str(steps) for steps in settings.unit_steps()),
        "--shards",
        str(settings.outer_shards),
        "--shard",
        str(shard),
    ]


def gateway_args(settings: UpSettings, nats_url: str, port: int) -> list[str]:
    """``diloco gateway`` arguments: local mode (the token goes by environment, not on the
    command line, where ``ps`` would show it), and the folder REST jobs may take corpora from."""
    data_root = ["--data-root", settings.data_root] if settings.data_root else []
    return [
        "gateway",
        "--nats-url",
        nats_url,
        "--job",
        settings.job,
        "--port",
        str(port),
        "--local",
        *data_root,
    ]


def link_args(
    settings: UpSettings, nats_url: str, name: str, spec: LinkSpec, port: int, outages: str
) -> list[str]:
    """``diloco link`` arguments: a shaped link named ``name`` (a unit or ``outer``) of the job,
    listening on ``port`` in front of the nats-server at ``nats_url``."""
    return [
        "link",
        "--nats-url",
        nats_url,
        "--job",
        settings.job,
        "--name",
        name,
        "--link",
        spec.text(),
        "--outages",
        outages,
        "--listen-port",
        str(port),
    ]


def learner_args(settings: UpSettings, nats_url: str, unit: int) -> list[str]:
    """``diloco learner`` arguments of one unit: its slowdown and its share of the budget."""
    return [
        "learner",
        "--nats-url",
        nats_url,
        *flags_for(settings, LearnerSettings, LEARNER_OWN),
        "--unit",
        str(unit),
        "--num-units",
        str(settings.learners),
        "--slowdown",
        str(settings.unit_slowdowns()[unit]),
        "--max-steps",
        str(settings.unit_steps()[unit]),
        "--checkpoint-dir",
        str(checkpoint_dir(settings)),
        *(("--adversary", settings.adversary) if unit < settings.adversaries else ()),
    ]
