"""``bench/codec_parts.py``'s claims (the public routes do the codec's work; the Numba quantiser
earns its place; ``shared.codec.zstd`` costs what python-zstandard costs; the fast hash log pays;
Numba's cache removes the compile) hold for figures that meet them and fail for those that do
not, from hand-built results."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers import REPO, load_bench_script


@pytest.fixture
def parts_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("codec_parts", monkeypatch)


def results(
    module: ModuleType,
    *,
    identical: bool = True,
    numba_ms: float = 0.2,
    zstd_ms: float = 0.30,
    plain_ms: float = 0.37,
    cached_s: float = 0.3,
) -> object:
    """Results for one `small` upload (payload 0.67 MB: 5.36 ms at 1 Gbit/s)."""
    import codec_uploads  # bench/ is on sys.path once the script is loaded

    times = dict.fromkeys(codec_uploads.ROWS, 1e-3)
    times |= {"q_numba": numba_ms / 1e3, "q_np": 1.3e-3}
    times |= {"z1": 0.68e-3, "z1_np": 0.70e-3, "d": 0.17e-3, "d_pub": 0.13e-3}
    times |= {"z-1": zstd_ms / 1e3, "z-1_np": 0.30e-3, "z-1_plain": plain_ms / 1e3}
    checks = module.UploadChecks(
        numpy_codes_identical=True,
        jax_codes_differing=0,
        jax_scales_differing=100,
        jax_scales_max_ulps=1,
        jax_max_steps=1.5e-5,
        payload_identical={1: True, -1: identical},
        jax_payload_identical=False,
        decode_identical=True,
        jax_compile_s=0.2,
        jax_cpu_per_wall=1.3,
        blocks=2649,
    )
    upload = module.Upload(
        name="small", params=676_992, tensors=17, segments=1, filled="the first round",
        repeats=15, payload={1: 670_000, -1: 670_000}, plain_minus_1=670_000,
        times=times, walls=times, checks=checks,
    )  # fmt: skip
    compile_runs = [
        module.CompileRun(what="cold: x", import_s=0.3, warm_up_s=15.9, cpu_s=15.9, cache_files=18),
        module.CompileRun(
            what="cached: x", import_s=0.3, warm_up_s=cached_s, cpu_s=0.4, cache_files=18
        ),
    ]
    parts = [
        module.Part(kind=kind, part=part, cold_s=3e-4, hot_s=1e-4)
        for kind in ("real", "gaussian")
        for part in (module.COPY, "whole encode")
    ]
    provenance = module.Provenance(commit="c", command="x", machine="m", started="s")
    return module.CodecPartsResults(
        provenance=provenance, repeats=5, parts=parts, uploads=[upload], address_us=1.0,
        compile=compile_runs,
    )  # fmt: skip


def test_claims_hold_for_good_figures(parts_bench):
    good = results(parts_bench)
    checked = parts_bench.claims(good)
    assert len(checked) == 6 and all(c.holds for c in checked), checked
    shown = parts_bench.render(good, checked, REPO / "x.json")
    assert "Claims" in shown and "### Numba compile" in shown


@pytest.mark.parametrize(
    ("change", "failing"),
    [
        ({"identical": False}, "public routes"),
        ({"numba_ms": 1.0}, "Numba quantiser gains"),  # 0.3 ms of 5.36: 5.6%
        ({"zstd_ms": 0.45, "plain_ms": 0.6}, "cost what python-zstandard"),  # 0.15 of 5.36 ms
        ({"plain_ms": 0.31, "zstd_ms": 0.30}, "hash log"),  # 1.03×
        ({"cached_s": 2.0}, "Numba's cache"),
    ],
)
def test_each_claim_fails_for_figures_that_break_it(parts_bench, change, failing):
    checked = parts_bench.claims(results(parts_bench, **change))
    failed = [c.text for c in checked if c.holds is False]
    assert len(failed) == 1 and failing in failed[0], failed


def test_claims_are_not_measured_without_figures(parts_bench):
    empty = results(parts_bench)
    empty.uploads, empty.compile = [], []
    assert all(c.holds is None for c in parts_bench.claims(empty))
