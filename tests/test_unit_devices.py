"""A learner unit on several devices (services/learner/devices.py): the same global batch
trains the same model on 1 device and on 4 forced CPU devices, with the state replicated or
sharded, and the uploads carry the same pseudo-gradients."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import nats
import numpy as np
import pytest

from services.learner.devices import UnitDevices, unit_devices
from services.learner.settings import LearnerSettings
from services.orchestration import commands
from services.orchestration.local.settings import UpSettings
from services.orchestration.nats_server import free_port
from shared import kv, subjects
from shared.codec.api import decode_tensors, encode_tensors
from shared.model_config import get_config
from shared.records import MAX_BATCH_SIZE
from shared.records.jobs import DesiredRecord
from tests.helpers import computed_once, run_up_to_end, wait_for
from tests.test_faults import assert_books_balance, unit_status, wait_caught_up

DEVICES = 4
ROOT = Path(__file__).resolve().parent.parent
# Float32 sums over 4 devices add the gradient's parts in another order than one device does.
LOSS_RTOL = 1e-5
DELTA_ATOL = 1e-5
BLOCK = 256


@pytest.fixture(scope="session")
def device_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``tests/unit_devices_run.py`` in a process that sees 4 CPU devices, run once for the
    whole run (:func:`computed_once`)."""

    def compute() -> str:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
        ).strip()
        env["JAX_PLATFORMS"] = "cpu"
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "unit_devices_run.py"), str(DEVICES)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    return json.loads(computed_once(tmp_path_factory, "unit-devices-runs", compute))


@pytest.mark.parametrize(
    ("layout", "reference"), [("replicated", "one"), ("sharded", "one"), ("sharded", "replicated")]
)
def test_four_devices_follow_the_single_device_loss_over_50_steps(device_runs, layout, reference):
    expected = np.array(device_runs[reference]["losses"])
    many = np.array(device_runs[layout]["losses"])
    assert len(expected) == len(many) == 50
    np.testing.assert_allclose(many, expected, rtol=LOSS_RTOL)
    assert expected[-1] < expected[0] - 1.0, "the run must train, or the comparison proves nothing"


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_uploads_on_four_devices_decode_to_the_single_device_pseudo_gradient(device_runs, layout):
    one, many = device_runs["one"]["uploads"], device_runs[layout]["uploads"]
    assert [u["fragment"] for u in many] == [u["fragment"] for u in one]
    assert len(one) == 10
    for reference, upload in zip(one, many, strict=True):
        expected = np.array(reference["values"], np.float32)
        values = np.array(upload["values"], np.float32)
        payload, description = encode_tensors({"delta": values}, "int8", BLOCK)
        decoded = decode_tensors(payload, description)["delta"]
        # The int8 codec's bound: half a step of each block's scale (absmax / 127).
        padded = np.pad(np.abs(values), (0, -len(values) % BLOCK)).reshape(-1, BLOCK)
        bound = np.repeat(padded.max(axis=1) / 254, BLOCK)[: len(values)]
        assert np.all(np.abs(decoded - expected) <= bound + DELTA_ATOL)


def test_sharded_state_puts_a_quarter_on_each_device_and_replicated_all(device_runs):
    sharded = device_runs["sharded"]["state_share_per_device"]
    assert len(sharded) == DEVICES
    # The tiny model's every tensor has an axis 4 divides; the optimizer's step count is
    # replicated (a few bytes).
    assert all(abs(share - 1 / DEVICES) < 0.01 for share in sharded), sharded
    assert device_runs["replicated"]["state_share_per_device"] == [1.0] * DEVICES


def test_a_tensor_is_split_along_its_largest_axis_that_the_devices_divide(device_runs):
    assert device_runs["specs"] == {
        "(2, 48, 144)": [None, None, "data"],
        "(2, 48)": [None, "data"],
        "(64, 48)": ["data", None],
        "(6,)": [],
        "(3, 5)": [],
        "()": [],
    }
    # One device: everything replicated, sharded or not.
    device = jax.local_devices()[0]
    assert UnitDevices([device], shard_params=True).sharding_for((8, 4)).is_fully_replicated


def test_asking_for_more_devices_than_present_is_refused_with_what_is_present():
    present = len(jax.local_devices())
    assert len(unit_devices(0)) == present
    with pytest.raises(ValueError, match=f"this process has {present}"):
        unit_devices(present + 1)


def test_devices_and_shard_params_are_learner_settings():
    settings = LearnerSettings(devices=2, shard_params=True)
    assert (settings.devices, settings.shard_params) == (2, True)
    assert LearnerSettings().devices == 0  # all of the process's devices


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_up_with_two_devices_per_unit_trains_end_to_end(tmp_path, jax_cache):
    """``diloco up --devices-per-unit 2`` with the default settings (tiny model): each unit
    trains on two CPU devices of its own, twice the sequences per step, and the outer takes its
    uploads' token counts; the run finishes, the model learns, the books balance."""
    summary, output = run_up_to_end(
        tmp_path,
        jax_cache,
        *("--devices-per-unit", "2", "--max-steps", "60", "--h-steps", "10"),
    )
    line = next(x for x in output.splitlines() if x.startswith("held-out eval loss"))
    init_loss, final_loss = (float(x) for x in line.split()[3:6:2])
    assert final_loss < init_loss - 1.0, output
    batch = LearnerSettings().batch_size
    seq_len = get_config("tiny").seq_len
    for unit in (0, 1):
        status = summary.units[unit]
        assert status.tokens_per_step == 2 * batch * seq_len, status
        assert status.step == 60 and status.tokens == 60 * 2 * batch * seq_len, status
        log = (tmp_path / "cluster-data" / "logs" / f"learner-{unit}.log").read_text()
        assert "trains on 2 device(s)" in log, log[-2000:]
    # No upload refused: the outer allows the units' tokens per step (implausible_work).
    assert summary.ledger.rejected == 0, summary.ledger


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_unit_of_two_processes_trains_as_one_and_only_process_0_speaks_on_nats(
    nats_server, services, tmp_path
):
    """A unit spanning two processes (``--num-processes 2``, jax.distributed over Gloo, one
    CPU device each): process 0 uploads, reports and fetches the globals; process 1 trains the
    same steps on its half of each batch, adopts what process 0 adopts, and never connects to
    NATS. Created idle, it starts when told; killed (both processes) and started again, it goes
    on from process 0's checkpoint; the two end with the same params, every round is applied
    and the books balance."""
    job, steps, batch = "twoprocs", 60, 8
    flags = ["--nats-url", nats_server.url, "--job", job, "--model", "tiny", "--seed", "1"]
    services.start("outer", "outer", *flags, "--num-units", "1", "--batch-size", str(2 * batch))
    unit = [
        *("--unit", "0", "--num-units", "1", "--max-steps", str(steps), "--h-steps", "10"),
        *("--batch-size", str(batch), "--no-dynamic-h", "--status-interval-s", "0.5"),
        *("--slowdown", "3", "--checkpoint-dir", str(tmp_path / "units")),
        *("--checkpoint-every-s", "1"),
        *("--num-processes", "2", "--coordinator", f"127.0.0.1:{free_port()}"),
    ]

    def start(*extra: str) -> tuple:
        leader = services.start("learner-0", "learner", *flags, *unit, *extra, "--process-id", "0")
        follower = services.start(
            "learner-0-1", "learner", *flags, *unit, *extra, "--process-id", "1"
        )
        return leader, follower

    # Created idle: both wait (process 0 tells process 1 so, step after step) until started.
    leader, follower = start("--initial-state", "idle")
    wait_for(lambda: "unit 0 idle at step 0" in services.log("learner-0"), 120, "an idle unit")
    asyncio.run(_set_desired(nats_server.url, job, 0, "running"))

    def trained(at_least: int) -> bool:
        status = unit_status(nats_server.url, job, 0)
        return status is not None and status.step >= at_least

    wait_for(lambda: trained(25), 120, "25 steps")
    for process in (leader, follower):
        process.kill()
        process.wait(timeout=30)
    leader, follower = start()
    assert leader.wait(timeout=300) == 0, services.logs()
    assert follower.wait(timeout=60) == 0, services.logs()
    follower_log = services.log("learner-0-1")
    assert "process 1 follows process 0 of unit 0" in follower_log, follower_log
    assert "nats" not in follower_log.lower(), follower_log
    leader_end = _summary(services.log("learner-0"), "unit 0 done: ")
    follower_end = _summary(follower_log, "process 1 of unit 0 done: ")
    assert leader_end["restored_from_step"] >= 20, leader_end
    assert leader_end["steps"] == follower_end["steps"] == steps
    # Both trained the same steps and adopted the same globals: they end with the same bits.
    assert follower_end["adopted"] >= 1, follower_end
    assert follower_end["params_checksum"] == leader_end["params_checksum"]
    status = unit_status(nats_server.url, job, 0)
    assert status is not None and status.step == steps, status
    assert status.tokens_per_step == 2 * batch * get_config("tiny").seq_len, status
    wait_caught_up(nats_server.url, job)
    books = assert_books_balance(nats_server.url, job)
    assert books.applied >= steps // 10 and books.rejected == 0, books


def _summary(log: str, prefix: str) -> dict:
    """The summary dict a learner process logs as it ends (after ``prefix``)."""
    line = next(x for x in reversed(log.splitlines()) if prefix in x)
    return ast.literal_eval(line.split(prefix, 1)[1])


async def _set_desired(url: str, job: str, unit: int, state: str) -> None:
    nc = await nats.connect(url)
    try:
        bucket = await nc.jetstream().key_value(subjects.DESIRED_BUCKET)
        await kv.put(bucket, subjects.desired_key(job, unit), DesiredRecord(state=state))
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"num_processes": 2, "process_id": 2, "coordinator": "h:1"}, "must be < num-processes"),
        ({"num_processes": 2}, "needs --coordinator"),
        ({"num_processes": 2, "coordinator": "h:1", "shard_params": True}, "one process's"),
        ({"num_processes": 2, "coordinator": "h:1", "mode": "sync"}, "--mode sync"),
    ],
)
def test_what_a_unit_of_several_processes_cannot_do_is_refused_with_the_reason(flags, message):
    with pytest.raises(ValueError, match=message):
        LearnerSettings(**flags)


def test_up_refuses_more_sequences_per_step_than_a_unit_may_train():
    UpSettings(batch_size=16, devices_per_unit=4)
    with pytest.raises(ValueError, match=f"more than {MAX_BATCH_SIZE} sequences"):
        UpSettings(batch_size=MAX_BATCH_SIZE, devices_per_unit=2)


def test_up_gives_each_unit_its_devices_and_the_outer_their_batch(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    settings = UpSettings(batch_size=8, devices_per_unit=2)
    env = commands.learner_env(settings, 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "--xla_force_host_platform_device_count=2" in env["XLA_FLAGS"]
    args = commands.learner_args(settings, "nats://x", 1)
    assert args[args.index("--devices") + 1] == "2"
    outer = commands.outer_args(settings, "nats://x")
    assert outer[outer.index("--batch-size") + 1] == "16"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert commands.learner_env(settings, 1)["CUDA_VISIBLE_DEVICES"] == "6,7"
