"""A learner unit on several devices (services/learner/devices.py): the same global batch
trains the same model on 1 device and on 4 forced CPU devices, with the state replicated or
sharded, and the uploads carry the same pseudo-gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from services.learner.devices import UnitDevices, local_devices
from services.learner.settings import LearnerSettings
from shared.codec.api import decode_tensors, encode_tensors
from shared.model_config import get_config
from tests.helpers import run_up_to_end

DEVICES = 4
ROOT = Path(__file__).resolve().parent.parent
# Float32 sums over 4 devices add the gradient's parts in another order than one device does.
LOSS_RTOL = 1e-5
DELTA_ATOL = 1e-5
BLOCK = 256


@pytest.fixture(scope="module")
def runs() -> dict:
    """``tests/unit_devices_run.py`` in a process that sees 4 CPU devices."""
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
    return json.loads(done.stdout)


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_four_devices_follow_the_single_device_loss_over_50_steps(runs, layout):
    one = np.array(runs["one"]["losses"])
    many = np.array(runs[layout]["losses"])
    assert len(one) == len(many) == 50
    np.testing.assert_allclose(many, one, rtol=LOSS_RTOL)
    assert one[-1] < one[0] - 1.0, "the run must train, or the comparison proves nothing"


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_uploads_on_four_devices_decode_to_the_single_device_pseudo_gradient(runs, layout):
    one, many = runs["one"]["uploads"], runs[layout]["uploads"]
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


def test_sharded_state_puts_a_quarter_on_each_device_and_replicated_all(runs):
    sharded = runs["sharded"]["state_share_per_device"]
    assert len(sharded) == DEVICES
    # The tiny model's every tensor has an axis 4 divides; the optimizer's step count is
    # replicated (a few bytes).
    assert all(abs(share - 1 / DEVICES) < 0.01 for share in sharded), sharded
    assert runs["replicated"]["state_share_per_device"] == [1.0] * DEVICES


def test_a_tensor_is_split_along_its_largest_axis_that_the_devices_divide(runs):
    assert runs["specs"] == {
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
    assert len(local_devices(0)) == present
    with pytest.raises(ValueError, match=f"this process has {present}"):
        local_devices(present + 1)


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
