"""``bench/codec.py``'s claims (the error bounds of docs/CODEC.md, the compression ratios the docs
quote) hold for figures that meet them and fail for those that do not, from hand-built rows."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers import REPO, load_bench_script


@pytest.fixture
def codec_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("codec", monkeypatch)


def results(module: ModuleType, error_scale: float = 0.5, ratio_scale: float = 1.05):
    n = module.SIZES["1M"]
    rows = []
    for name, bound in module.MAX_ERROR.items():
        ratio = module.MIN_RATIO.get(name, 1.0) * ratio_scale
        for kind in ("gaussian", "real"):
            rows.append(
                module.Row(
                    size="1M",
                    kind=kind,
                    codec=name,
                    level=1,
                    encode_s=1e-3,
                    dict_encode_s=1e-3,
                    decode_s=1e-3,
                    raw_size=n,
                    payload_size=int(4 * n / ratio),
                    error=bound * error_scale,
                    copy_s=1e-3,
                )  # fmt: skip
            )
    provenance = module.Provenance(commit="c", command="x", machine="m", started="s")
    return module.CodecResults(
        provenance=provenance, sizes=["1M"], repeats={"1M": 2}, captured_s=0.0,
        real_tensors=1, real_params=n, real_rounds=1, rows=rows,
        copies={"1M gaussian": 1e-3, "1M real": 1e-3}, copytos={"1M": 1e-3},
    )  # fmt: skip


def test_claims_hold_for_good_rows(codec_bench):
    checked = codec_bench.claims(results(codec_bench, error_scale=0.5))
    assert all(c.holds for c in checked), checked
    assert len(checked) == len(codec_bench.MAX_ERROR) + len(codec_bench.MIN_RATIO)
    assert "Claims" in codec_bench.render(results(codec_bench), checked, REPO / "x.json")


def test_claims_fail_for_bad_rows(codec_bench):
    worse = codec_bench.claims(results(codec_bench, error_scale=1.5, ratio_scale=0.9))
    failed = {c.text.split(":")[0] for c in worse if c.holds is False}
    # every codec but fp32, whose error stays 0 (1.5 × its bound of 0)
    assert failed == set(codec_bench.MAX_ERROR) - {"fp32"} | set(codec_bench.MIN_RATIO)
    empty = results(codec_bench)
    empty.rows = []
    assert all(c.holds is None for c in codec_bench.claims(empty))
