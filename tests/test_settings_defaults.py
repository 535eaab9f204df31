"""Every setting has one default: ``diloco up``, a job created through the REST API and the
simulator get the same value for every workload, algorithm and codec setting, and so do the
learner and outer processes each of them starts."""

from __future__ import annotations

import pytest

from services.learner.settings import LearnerSettings
from services.orchestration import commands, reconcile
from services.orchestration.local.settings import UpSettings
from services.outer.settings import OuterSettings
from shared.records.jobs import JobRecord, JobSpec
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.codec import CodecSettings
from shared.settings.workload import DEFAULT_UNITS, UnitsSettings, WorkloadSettings
from sim.training import SimSetup
from tests.helpers import service_settings

GROUPS = (WorkloadSettings, AlgorithmSettings, CodecSettings)
FIELDS = [(group, name) for group in GROUPS for name in group.model_fields]
NATS_URL = "nats://127.0.0.1:4222"


@pytest.fixture(scope="module")
def everywhere() -> dict[str, object]:
    """Every place a job's settings are read, with no setting given."""
    up = UpSettings()
    spec = JobSpec(job=up.job)
    record = JobRecord(spec=spec, state="running", units=spec.units, created=0.0, updated=0.0)
    up_learner = commands.learner_args(up, NATS_URL, 0)
    rest_learner = [*reconcile.learner_args(record, 0, "/tmp/units"), "--nats-url", NATS_URL]
    setup = SimSetup()
    return {
        "diloco up": up,
        "REST job": spec,
        "simulator": {
            **setup.workload.model_dump(),
            **setup.algorithm.model_dump(),
            **setup.codec.model_dump(),
        },
        "learner of diloco up": service_settings(LearnerSettings, up_learner),
        "outer of diloco up": service_settings(OuterSettings, commands.outer_args(up, NATS_URL)),
        "learner of a REST job": service_settings(LearnerSettings, rest_learner),
        "outer of a REST job": service_settings(OuterSettings, reconcile.outer_args(record)),
        "diloco learner": LearnerSettings(),
        "diloco outer": OuterSettings(),
    }


@pytest.mark.parametrize(("group", "name"), FIELDS, ids=[name for _, name in FIELDS])
def test_every_setting_has_the_same_default_everywhere(everywhere, group, name):
    default = group.model_fields[name].default
    seen = {}
    for where, settings in everywhere.items():
        if isinstance(settings, dict):
            seen[where] = settings[name]
        elif name in type(settings).model_fields:
            seen[where] = getattr(settings, name)
    assert {"diloco up", "REST job", "simulator"} <= seen.keys()
    assert all(value == default for value in seen.values()), seen


def test_every_place_has_the_same_number_of_units(everywhere):
    units = {
        "diloco up": everywhere["diloco up"].learners,
        "REST job": everywhere["REST job"].units,
        "simulator": SimSetup().num_units,
        "diloco learner": LearnerSettings().num_units,
        "diloco outer": OuterSettings().num_units,
    }
    assert set(units.values()) == {DEFAULT_UNITS}, units
    assert UnitsSettings.model_fields["num_units"].default == DEFAULT_UNITS


def test_a_rest_job_can_set_every_algorithm_and_codec_setting():
    assert set(AlgorithmSettings.model_fields) <= set(JobSpec.model_fields)
    assert set(CodecSettings.model_fields) <= set(JobSpec.model_fields)
    assert set(WorkloadSettings.model_fields) <= set(JobSpec.model_fields)


def test_a_rest_jobs_settings_reach_its_processes():
    changes = {
        "mode": "sync",
        "combine": "median",
        "merge_policy": "quorum",
        "min_quorum": 2,
        "norm_guard": "clip",
        "norm_guard_factor": 5.0,
        "inner_lr": 1e-3,
        "h_steps": 12,
        "codec": "int4",
        "params_codec": "bf16",
        "params_downlink": "copy",
        "params_delta_codec": "int2",
        "batch_size": 8,
        "heldout_fraction": 0.05,
    }
    spec = JobSpec(job="j", units=3, **changes)
    record = JobRecord(spec=spec, state="running", units=3, created=0.0, updated=0.0)
    learner = service_settings(
        LearnerSettings, [*reconcile.learner_args(record, 1, "/tmp/u"), "--nats-url", NATS_URL]
    )
    outer = service_settings(OuterSettings, reconcile.outer_args(record))
    for name, value in changes.items():
        got = [getattr(s, name) for s in (learner, outer) if name in type(s).model_fields]
        assert got and all(v == value for v in got), (name, got)
    assert (learner.num_units, learner.unit, outer.num_units) == (3, 1, 3)


@pytest.mark.parametrize(
    ("upload", "delta"), [("fp32", "int4"), ("int8", "int4"), ("int4", "int2"), ("int2", "int2")]
)
def test_the_delta_codec_follows_the_upload_codec_to_the_outer(upload, delta):
    up = UpSettings(codec=upload)
    spec = JobSpec(job="j", codec=upload)
    record = JobRecord(spec=spec, state="running", units=spec.units, created=0.0, updated=0.0)
    outers = [
        service_settings(OuterSettings, commands.outer_args(up, NATS_URL)),
        service_settings(OuterSettings, reconcile.outer_args(record)),
    ]
    assert [outer.params_delta_codec for outer in outers] == [delta, delta]
    # A REST job's stored spec keeps it; a codec set by hand wins.
    assert JobSpec.model_validate_json(spec.model_dump_json()).params_delta_codec == delta
    assert CodecSettings(codec=upload, params_delta_codec="int8").params_delta_codec == "int8"


def test_the_outer_is_told_the_steps_its_learners_train():
    """Peer review follows the learners' learning rate, whose cosine decay spans their
    ``--max-steps``: each launcher passes those to the outer as ``--learner-steps``."""
    up = UpSettings(learners=3, max_steps=90, slowdowns="1,1,2")
    outer = service_settings(OuterSettings, commands.outer_args(up, NATS_URL))
    learners = [
        service_settings(LearnerSettings, commands.learner_args(up, NATS_URL, unit))
        for unit in range(3)
    ]
    assert outer.learner_horizons() == tuple(learner.max_steps for learner in learners)
    spec = JobSpec(job="j", units=3, max_steps=70)
    record = JobRecord(spec=spec, state="running", units=3, created=0.0, updated=0.0)
    outer = service_settings(OuterSettings, reconcile.outer_args(record))
    learner = service_settings(
        LearnerSettings, [*reconcile.learner_args(record, 2, "/tmp/u"), "--nats-url", NATS_URL]
    )
    assert outer.learner_horizons() == (learner.max_steps,) == (70,)
