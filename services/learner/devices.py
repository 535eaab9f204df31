"""The devices a learner unit trains on, and where its arrays live on them.

A unit is an island of devices trained as one (the seed's learner unit: a pod slice, a GPU
node): a 1-D ``jax.sharding.Mesh`` over its local devices with one axis, ``data``. Each inner
step's batch is split along that axis (data parallelism: each device takes
``batch / devices`` sequences, and XLA sums the gradients over the mesh inside the one jitted
step). The parameters, the anchor and the AdamW moments are either replicated on every device,
or, with ``shard_params``, split along the mesh as in FSDP (ZeRO-3): each array along its
largest axis that the devices divide, so that each device holds about 1/N of the state and
XLA gathers a layer's weights where the step needs them. An array no axis of which the
devices divide (a scalar, a small bias) is replicated.

The math does not change with the layout: the same global batch gives the same loss on one
device and on N, up to the order of float additions in the gradient's sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: The mesh's one axis: the batch is split along it, and so is sharded state.
AXIS = "data"


class UnitDevices:
    """A unit's mesh, and the sharding of its batches and of its state."""

    def __init__(self, devices: Sequence[jax.Device], shard_params: bool = False) -> None:
        if not devices:
            raise ValueError("a unit needs at least one device")
        self.devices = list(devices)
        self.shard_params = shard_params
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.batch = NamedSharding(self.mesh, PartitionSpec(AXIS))

    @property
    def count(self) -> int:
        """Devices in the mesh."""
        return len(self.devices)

    def sharding_for(self, shape: Sequence[int]) -> NamedSharding:
        """Where an array of ``shape`` of the unit's state lives: replicated, or with
        ``shard_params`` split along its largest axis that the devices divide."""
        if not self.shard_params or self.count == 1:
            return self.replicated
        divisible = [axis for axis, size in enumerate(shape) if size % self.count == 0]
        if not divisible:
            return self.replicated
        axis = max(divisible, key=lambda a: shape[a])
        spec = [None] * len(shape)
        spec[axis] = AXIS
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def shardings(self, tree: Any) -> Any:
        """The sharding of every leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
        return jax.tree.map(lambda leaf: self.sharding_for(np.shape(leaf)), tree)

    def place(self, tree: Any) -> Any:
        """``tree`` on the mesh, each leaf as :meth:`sharding_for` says."""
        return jax.device_put(tree, self.shardings(tree))

    def place_batch(self, batch: np.ndarray) -> jax.Array:
        """A global batch (``(B, T+1)``) split along its rows over the mesh.

        Raises:
            ValueError: the devices do not divide the batch's rows.
        """
        if batch.shape[0] % self.count:
            raise ValueError(
                f"a batch of {batch.shape[0]} sequences cannot be split over {self.count} devices"
            )
        return jax.device_put(batch, self.batch)


def unit_devices(count: int) -> list[jax.Device]:
    """The devices a unit trains on: the first ``count`` of each of its processes' devices
    (0: all of them; a unit of one process has only its own).

    Raises:
        ValueError: this process has fewer devices than ``count``.
    """
    present = jax.local_devices()
    if count > len(present):
        raise ValueError(
            f"--devices {count}: this process has {len(present)} "
            f"{present[0].platform.upper()} device(s) ({', '.join(map(str, present))})"
        )
    by_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    return [d for p in sorted(by_process) for d in by_process[p][: count or None]]
