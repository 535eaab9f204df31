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
    {"unit", "num_units", "max_steps", "slowdown", "checkpoint_dir", "adversary", "devices"}
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


def devices_env(devices: int, unit: int) -> dict[str, str]:
    """Environment that gives learner unit ``unit`` its ``devices`` devices: GPUs
    ``unit * devices`` onwards of those the launcher sees (``$CUDA_VISIBLE_DEVICES``, else
    all), and as many CPU devices of its own (XLA makes one by default), which JAX uses where
    there is no GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = unit * devices
    gpus = visible.split(",")[first : first + devices] if visible else range(first, first + devices)
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }


def learner_env(settings: UpSettings, unit: int | None = None) -> dict[str, str]:
    """Environment of a learner: the cache, bounded XLA threads, and, for one of the run's
    own units (``unit``), its devices (a REST job's learner takes what its process finds)."""
    env = {**cache_env(settings), **threads_env(settings.learner_threads)}
    if unit is not None:
        devices = devices_env(settings.devices_per_unit, unit)
        env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {devices.pop('XLA_FLAGS')}"
        env.update(devices)
    return env


def outer_args(settings: UpSettings, nats_url: str, shard: int = 0) -> list[str]:
    """``diloco outer`` arguments of the job's outer shard ``shard``."""
    return [
        "outer",
        "--nats-url",
        nats_url,
        *flags_for(settings, OuterSettings, OUTER_OWN | {"batch_size"}),
        "--num-units",
        str(settings.learners),
        "--learner-steps",
        ",".join(str(steps) for steps in settings.unit_steps()),
        # The most sequences a unit's inner step trains: --batch-size on each of its devices.
        "--batch-size",
        str(settings.batch_size * settings.devices_per_unit),
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
        "--devices",
        str(settings.devices_per_unit),
        *(("--adversary", settings.adversary) if unit < settings.adversaries else ()),
    ]
