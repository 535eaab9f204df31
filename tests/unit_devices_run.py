"""One learner unit's training on 1 device and on N, in a process of its own (run by
``tests/test_unit_devices.py`` with N forced CPU devices: XLA reads
``--xla_force_host_platform_device_count`` only when JAX starts).

Trains the tiny model for ``STEPS`` inner steps from the same params on the same global batches
three ways: one device; N devices, state replicated; N devices, state sharded
(``--shard-params``). Prints one JSON object: each run's losses, its uploads' pseudo-gradients
(flat float32 lists) and the share of the state's bytes on each device; and the sharding
``--shard-params`` gives a few shapes.
"""

from __future__ import annotations

import json
import sys

import jax

from services.learner.core import LearnerCore
from services.learner.devices import UnitDevices
from services.learner.trainer import InnerTrainer, inner_optimizer
from shared import data, model
from shared.settings.algorithm import InnerAlgorithmSettings

CFG = model.get_config("tiny")
STEPS = 50
H_STEPS = 10
PER_DEVICE_BATCH = 2
#: Shapes whose sharding the test checks (with 4 devices).
SHAPES = [(2, 48, 144), (2, 48), (64, 48), (6,), (3, 5), ()]


def run(devices: UnitDevices, batch: int) -> dict:
    corpus = data.split_corpus(data.load_corpus(None, 200_000), 0.1)
    sampler = data.BatchSampler(corpus.train, CFG.seq_len, batch, 0, 0)
    trainer = InnerTrainer(CFG, inner_optimizer(3e-3, 5, STEPS, 0.1), devices)
    params = model.init_params(CFG, jax.random.PRNGKey(0))
    schedule = InnerAlgorithmSettings(h_steps=H_STEPS, stagger="always").sync_schedule(2)
    core = LearnerCore(trainer, params, schedule, batch * CFG.seq_len)
    losses, uploads = [], []
    for step in range(STEPS):
        losses.append(core.train_step(sampler.batch(step)))
        for upload in core.due_uploads():
            uploads.append({"fragment": upload.fragment, "values": upload.values.tolist()})
    state_leaves = jax.tree.leaves((core.state.params, core.state.opt_state))
    total = sum(leaf.nbytes for leaf in state_leaves)
    per_device = [
        sum(
            shard.data.nbytes
            for leaf in state_leaves
            for shard in leaf.addressable_shards
            if shard.device == device
        )
        / total
        for device in devices.devices
    ]
    return {
        "losses": [float(loss) for loss in losses],
        "uploads": uploads,
        "state_share_per_device": per_device,
    }


def main() -> None:
    count = int(sys.argv[1])
    present = jax.local_devices()
    assert len(present) >= count, f"{len(present)} devices, {count} wanted"
    batch = PER_DEVICE_BATCH * count
    sharded = UnitDevices(present[:count], shard_params=True)
    result = {
        "one": run(UnitDevices(present[:1]), batch),
        "replicated": run(UnitDevices(present[:count]), batch),
        "sharded": run(sharded, batch),
        "specs": {str(shape): list(sharded.sharding_for(shape).spec) for shape in SHAPES},
    }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
