"""The private APIs of other packages that the code relies on, and the pins that protect them.

pyproject.toml caps every package whose private API the code touches; requirements.lock pins
the exact versions that ``make install`` and CI install, requirements-runtime.lock the same
versions of the runtime packages alone, which the Dockerfile installs. When one of these
tests fails after an upgrade, the message names the package, the private attribute and the
file that uses it: adapt that file before raising the pin.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import services.cli

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "requirements.lock"
RUNTIME_LOCK = ROOT / "requirements-runtime.lock"  # what the image installs (Dockerfile)

# Package -> the file whose use of its private API the upper bound in pyproject.toml protects.
PRIVATE_API_USERS = {
    "numba": "shared/codec/quantize.py _float32_at / encode_segment (intrinsic, inttoptr, carray)",
    "pydantic-settings": "shared/settings/cli.py JobConfigSource._read_file and "
    "settings_from_args (BaseSettings(_build_sources=...))",
}


def _broken(package: str, what: str) -> str:
    """The failure message: what changed, which pin protects it, and what to check."""
    try:
        installed = version(package)
    except PackageNotFoundError:
        installed = "not installed"
    return (
        f"{package} {installed}: {what}. The pin on {package} in pyproject.toml protects this "
        f"private API; check {PRIVATE_API_USERS[package]} before raising it (or re-run "
        f"`make install` if the installed version is not the one requirements.lock pins)."
    )


def _project_requirements() -> dict[str, Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    parsed = [Requirement(text) for text in requirements]
    return {canonicalize_name(req.name): req for req in parsed}


@pytest.mark.parametrize("package", sorted(PRIVATE_API_USERS))
def test_private_api_packages_have_an_upper_bound_the_installed_version_meets(
    package: str,
) -> None:
    requirement = _project_requirements().get(package)
    assert requirement is not None, f"{package} is no longer a dependency in pyproject.toml"
    upper = [s for s in requirement.specifier if s.operator in ("<", "<=", "==", "~=", "===")]
    assert upper, (
        f"pyproject.toml requires {requirement} with no upper bound, but "
        f"{PRIVATE_API_USERS[package]} uses its private API: cap it at the next release "
        "that may change that API"
    )
    installed = Version(version(package))
    assert requirement.specifier.contains(installed, prereleases=True), _broken(
        package, f"the installed version is outside pyproject.toml's {requirement.specifier}"
    )


def _locked() -> dict[str, list[tuple[Requirement, Version]]]:
    """requirements.lock's pins that apply to this interpreter and platform, by package."""
    environment = default_environment()
    pins: dict[str, list[tuple[Requirement, Version]]] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line[0].isspace() or line.startswith(("#", "-")):
            continue  # hashes, comments and options
        requirement = Requirement(line.removesuffix("\\").strip())
        if requirement.marker is None or requirement.marker.evaluate(environment):
            (pinned,) = requirement.specifier
            assert pinned.operator == "==", f"requirements.lock does not pin {line!r}"
            pins.setdefault(canonicalize_name(requirement.name), []).append(
                (requirement, Version(pinned.version))
            )
    return pins


def test_the_lock_file_pins_every_dependency_within_pyproject_bounds() -> None:
    locked = _locked()
    assert locked, "requirements.lock lists no packages"
    stale = []
    for name, requirement in _project_requirements().items():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        pins = locked.get(name, [])
        if len(pins) != 1 or not requirement.specifier.contains(pins[0][1], prereleases=True):
            stale.append(f"{requirement} (locked: {[str(pin) for pin, _ in pins] or 'none'})")
    assert not stale, (
        "requirements.lock does not match pyproject.toml; run `make lock` and commit both: "
        + "; ".join(stale)
    )


def _lock_entries(path: Path) -> dict[str, list[str]]:
    """Each pin of a lock file (``name==version``) with its hash lines. Markers are left out: a
    package's platforms may be fewer without the dev tools (cffi only for trio on Windows)."""
    entries: dict[str, list[str]] = {}
    pin = ""
    for line in path.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith(("#", "-")):
            pin = line.removesuffix("\\").split(";")[0].strip()
            entries[pin] = []
        elif line.strip().startswith("--hash=") and pin:
            entries[pin].append(line.strip().removesuffix("\\").strip())
    return entries


def test_the_runtime_lock_has_the_full_locks_pins_without_the_dev_tools() -> None:
    full, runtime = _lock_entries(LOCK), _lock_entries(RUNTIME_LOCK)
    differ = [pin for pin, hashes in runtime.items() if full.get(pin) != hashes]
    assert not differ, (
        f"{RUNTIME_LOCK.name} pins these unlike {LOCK.name} (or with other hashes): {differ}; "
        "run `make lock` and commit both"
    )
    names = {canonicalize_name(Requirement(pin).name) for pin in runtime}
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    needed = {canonicalize_name(Requirement(text).name) for text in project["dependencies"]}
    assert needed <= names, f"{RUNTIME_LOCK.name} lacks {needed - names}: run `make lock`"
    dev = {canonicalize_name(Requirement(t).name) for t in project["optional-dependencies"]["dev"]}
    assert not (dev - needed) & names, (
        f"{RUNTIME_LOCK.name} has the dev tools {(dev - needed) & names}, which the image does "
        "not need: run `make lock`"
    )


# --------------------------------------------------------------------------- pydantic-settings


def test_pydantic_settings_file_reading_and_source_order_hooks_still_exist() -> None:
    import inspect

    from pydantic_settings import BaseSettings, TomlConfigSettingsSource

    checks = {
        "TomlConfigSettingsSource._read_file": callable(
            getattr(TomlConfigSettingsSource, "_read_file", None)
        ),
        "BaseSettings(_build_sources=...)": "_build_sources"
        in inspect.signature(BaseSettings.__init__).parameters,
    }
    missing = [name for name, present in checks.items() if not present]
    assert not missing, _broken("pydantic-settings", f"{', '.join(missing)} missing")


# --------------------------------------------------------------------------- numba


def test_numba_intrinsic_and_carray_still_exist() -> None:
    import llvmlite.ir
    import numba
    import numba.extending

    checks = {
        "numba.extending.intrinsic": hasattr(numba.extending, "intrinsic"),
        "numba.carray": hasattr(numba, "carray"),
        "llvmlite.ir.IRBuilder.inttoptr": hasattr(llvmlite.ir.IRBuilder, "inttoptr"),
    }
    missing = [name for name, present in checks.items() if not present]
    assert not missing, _broken("numba", f"{', '.join(missing)} missing")


def test_encode_segment_reads_tensors_through_their_addresses() -> None:
    """The compiled kernel follows integer addresses (intrinsic + inttoptr + carray)."""
    from shared.codec import quantize

    block = 16
    tensors = [np.linspace(-1, 1, 2 * block, dtype=np.float32), np.full(block, 3, np.float32)]
    tensors[1][:4] = -6.0
    pieces = np.array([(0, 0, 2 * block, 0, 2), (1, 0, block, 2, 1)], np.int64)
    addresses = np.array([quantize.address(x) for x in tensors], np.int64)
    for array in (pieces, addresses):
        array.setflags(write=False)  # as the codec passes them (one compiled version)
    raw = np.zeros(3 * (4 + block), np.uint8)  # int8: 3 float32 scales, then 3 blocks of codes
    try:
        returned = quantize.encode_segment(0, addresses, addresses, pieces, False, 8, block, raw)
    except Exception as err:  # typing or lowering errors of the intrinsic surface here
        pytest.fail(_broken("numba", f"quantize.encode_segment failed to compile or run: {err!r}"))
    assert tuple(returned) == (-1, -1), _broken("numba", f"encode_segment returned {returned}")
    scales = raw[:12].view(np.float32)
    codes = raw[12:].view(np.int8).reshape(3, block)
    decoded = codes * scales[:, None]
    expected = np.concatenate(tensors).reshape(3, block)
    np.testing.assert_allclose(
        scales,
        np.abs(expected).max(axis=1) / 127,
        rtol=1e-6,
        err_msg=_broken("numba", "encode_segment wrote wrong scales"),
    )
    assert np.all(np.abs(decoded - expected) <= scales[:, None] / 2 * (1 + 1e-6)), _broken(
        "numba", "encode_segment read the wrong memory through its addresses"
    )


# --------------------------------------------------------------------------- diloco --version


def test_version_prints_the_installed_package_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        services.cli.main(["--version"])
    assert exited.value.code in (0, None)
    assert capsys.readouterr().out == f"diloco {version('decoupled-diloco')}\n"


def test_version_does_not_import_jax() -> None:
    code = (
        "import sys\nfrom services.cli import main\ntry:\n    main(['--version'])\n"
        "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m.startswith('jax')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("diloco "), result.stdout
    assert lines[-1] == "[]", f"`diloco --version` imported {lines[-1]}"
