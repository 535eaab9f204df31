"""Settings, the gateway and the vocabularies import no implementation: no JAX, optax or Numba.

``diloco gateway``, ``diloco jobs|job|unit|units`` and the settings of every service are read
(and validated) without importing the training code, so the gateway and the client start in
a fraction of a second and need none of it. Each check runs in a fresh interpreter, so that
modules other tests imported cannot hide an import.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

HEAVY = ("jax", "optax", "numba")

_CHECK = """
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(",".join(heavy))
"""


def imported_heavy_modules(*modules: str) -> list[str]:
    """The JAX/optax/Numba modules a fresh interpreter holds after importing ``modules``."""
    result = subprocess.run(
        [sys.executable, "-c", _CHECK.format(modules=modules, heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [name for name in result.stdout.strip().split(",") if name]


@pytest.mark.parametrize(
    "module",
    [
        "services.gateway.app",
        "services.gateway.settings",
        "services.learner.settings",
        "services.learner.accounting",
        "shared.unit_counters",
        "services.outer.errors",
        "services.outer.settings",
        "services.orchestration.local.settings",
        "services.orchestration.local.run",
        "services.link.settings",
        "services.link.service",
        "services.loadtest.settings",
        "sim.cluster.scenarios",
        "services.cli",
        "services.gateway.client",
        "shared.settings",
        "shared.records",
        "shared.codec.config",
        "shared.codec.description",
        "shared.wire.envelope",
    ],
)
def test_module_imports_no_training_code(module: str) -> None:
    assert imported_heavy_modules(module) == []


def test_the_check_sees_a_heavy_import() -> None:
    assert "jax" in imported_heavy_modules("shared.model")


def test_the_load_test_runs_without_jax():
    """Synthetic units encode with the codec (Numba), but train nothing."""
    heavy = imported_heavy_modules("services.loadtest.run")
    assert not [name for name in heavy if name.split(".")[0] in ("jax", "optax")], heavy
