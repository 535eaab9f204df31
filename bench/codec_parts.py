"""Where the time of an int8 encode goes, and what the same work costs with public APIs only.

Three tables, one BENCHMARKS.md section:

1. **The parts of a 1M-value int8 encode.** ``bench/codec.py`` reports int8 encode at 1M
   values (4 MiB of fp32) of real pseudo-gradients near half the speed of ``np.copy``. This
   breaks that encode into its parts and times each one the way ``bench/codec.py`` times
   everything (a full ``gc.collect()`` right before each call, the collector off during it:
   cold caches), and again back to back (in cache):

   * the copy (``np.copy``) and the whole encode (``codec.encode_flat``, zstd level -1);
   * the quantiser alone (``quantize.encode_blocks`` over the buffer, int8, block 256);
   * a bare read of the same 4 MiB (``ndarray.max`` over its bits);
   * zstd level -1 on the 1 MiB of codes (the codec's own ``shared.codec.zstd.Compressor``), and
     on its first 1 KiB (the fixed cost of a cold call).

2. **The codec stack against public APIs, at the sizes learners upload.** One upload of the
   whole ``small``, ``medium`` and ``large`` model (one fragment, the model's own tensor
   shapes, int8, block 256, ``threads=0``), encoded and decoded by the project's codec
   (Numba kernels; zstd through ``shared.codec.zstd``) and by the same work written with
   public APIs only: a NumPy or a ``jax.jit`` quantiser giving the same codes and scales in
   the same segment layout, python-zstandard's public ``ZstdCompressor`` /
   ``ZstdDecompressor`` (same level; at level -1 also with the project's hash log through
   ``ZstdCompressionParameters``), the same XXH3 checksums and the same decode-side checks.
   Each time is also given as a share of the upload's transfer time at 1 Gbit/s (payload
   bytes × 8 / 10^9 s), and a second table gives the gain of each compiled piece, and of
   ``shared.codec.zstd``'s one payload buffer, over its public equivalent in the same terms. The
   payloads, codes and decoded values of the two routes are compared before anything is
   timed.

3. **Numba compile, cold and cached.** ``codec.warm_up()`` in a fresh process with
   ``NUMBA_CACHE_DIR`` pointed at an empty directory (every kernel compiles), then again
   with the same directory (every kernel loads from the cache).

Raw figures (every part's and row's best times, the checks, the compile runs) go to
``bench/results/codec_parts.json``; the section is rendered from that file, with its claims
under the tables: the public routes give the same bytes; the Numba quantiser gains more than the
10% of a ``small`` upload's link time that docs/CODEC.md requires of a compiled piece;
``shared.codec.zstd`` costs what python-zstandard's public API costs; the fast levels' hash log
pays; Numba's cache removes the compile.

    .venv/bin/python bench/codec_parts.py --write          # ≈ 3 min on 2 cores
    .venv/bin/python bench/codec_parts.py --render --write # the section from the stored results
    .venv/bin/python bench/codec_parts.py --quick          # the smoke version
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from codec import REPO, SIZES, load_rounds, make_dataset  # bench/codec.py
from codec import warm_up as warm_up_codec
from codec_routes import BLOCK, address_us, best
from codec_uploads import MODEL_REPEATS, MODELS, link_s, measure_model, upload_tables
from evidence import (
    Claim,
    Provenance,
    at_least,
    at_most,
    note,
    publish,
    render_claims,
    results_path,
    save,
)
from pydantic import BaseModel

from shared.codec import api as codec
from shared.codec import quantize, zstd
from shared.codec.config import CodecConfig
from shared.codec.layout import Layout

SECTION = "## Pseudo-gradient codec: the parts of a 1M-value int8 encode"
PROGRAM = ".venv/bin/python bench/codec_parts.py"
NAME = "codec_parts"
LEVEL = -1
COPY = "np.copy (the reference)"
# docs/CODEC.md: a compiled piece stays where it gains more than this share of the upload's
# transfer time at 1 Gbit/s over its public equivalent.
KEEP_GAIN = 0.10
# shared.codec.zstd is python-zstandard's public API plus one payload buffer: the two cost the
# same within this share of the link time.
SAME_COST = 0.02
# The fast levels' hash log (shared/codec/zstd.py) is at least this much faster than a plain
# ZstdCompressor(level=-1).
HASH_LOG_SPEED_UP = 1.05
# A cached Numba load takes at most this share of a cold compile.
CACHED_SHARE = 0.10


class Part(BaseModel):
    """One part of the 1M-value encode on one data set: best cold and in-cache times."""

    kind: str
    part: str
    cold_s: float
    hot_s: float


class UploadChecks(BaseModel):
    """What table 2 checks before timing: both routes do the same work."""

    numpy_codes_identical: bool
    jax_codes_differing: int
    jax_scales_differing: int
    jax_scales_max_ulps: int
    jax_max_steps: float
    payload_identical: dict[int, bool]
    jax_payload_identical: bool
    decode_identical: bool
    jax_compile_s: float
    jax_cpu_per_wall: float
    blocks: int


class Upload(BaseModel):
    """One model's upload in table 2: sizes, best CPU and wall time of every row, the checks."""

    name: str
    params: int
    tensors: int
    segments: int
    filled: str
    repeats: int
    payload: dict[int, int]  # zstd level: payload bytes
    plain_minus_1: int  # payload bytes at −1 without the project's hash log
    times: dict[str, float]
    walls: dict[str, float]
    checks: UploadChecks


class CompileRun(BaseModel):
    """``codec.warm_up()`` in a fresh process."""

    what: str
    import_s: float
    warm_up_s: float
    cpu_s: float
    cache_files: int


class CodecPartsResults(BaseModel):
    """``bench/results/codec_parts.json``."""

    provenance: Provenance
    repeats: int
    parts: list[Part] = []
    uploads: list[Upload] = []
    address_us: float = 0.0
    compile: list[CompileRun] = []


# --------------------------------------------------------------------------- table 1


def parts(buffer: np.ndarray, layout: Layout) -> dict[str, Callable[[], object]]:
    """The calls to time, by row label, on one data set's buffer."""
    blocks = buffer.size // BLOCK
    scales = np.empty(blocks, np.float32)
    codes = np.empty(blocks * BLOCK, np.uint8)
    no_residual = np.zeros(0, np.float32)
    quantise = partial(quantize.encode_blocks, buffer, no_residual, False, 8, BLOCK, scales, codes)
    quantise()
    compressor = zstd.Compressor(LEVEL)
    frame = np.empty(zstd.compress_bound(codes.size), np.uint8)
    first_kib = codes[:1024].copy()
    config = CodecConfig("int8", BLOCK, LEVEL, threads=0)
    return {
        "np.copy (the reference)": partial(np.copy, buffer),
        "whole encode (encode_flat, int8, zstd -1)": partial(
            codec.encode_flat, buffer, layout, config
        ),
        "quantiser alone (quantize.encode_blocks)": quantise,
        "bare read of the 4 MiB (max over the bits)": buffer.view(np.uint32).max,
        "zstd -1 on the 1 MiB of codes": partial(compressor.compress_into, codes, frame),
        "zstd -1 on 1 KiB of codes": partial(compressor.compress_into, first_kib, frame),
    }


def measure_parts(rounds: list[dict[str, np.ndarray]], repeats: int) -> list[Part]:
    """Every part's best cold and in-cache time, real data first."""
    out = []
    for kind in ("real", "gaussian"):
        ds = make_dataset("1M", kind, rounds)
        assert ds.buffer.size == SIZES["1M"]
        calls = parts(ds.buffer, ds.layout)
        cold = {label: best(call, repeats, cold=True) for label, call in calls.items()}
        hot = {label: best(call, repeats, cold=False) for label, call in calls.items()}
        for label in calls:
            out.append(Part(kind=kind, part=label, cold_s=cold[label], hot_s=hot[label]))
            note(
                f"  {kind} {label}: cold {cold[label] * 1e3:.3f} ms, "
                f"in cache {hot[label] * 1e3:.3f} ms"
            )
    return out


def parts_table(rows: list[Part], repeats: int) -> list[str]:
    lines = [
        f"The parts of `bench/codec.py`'s int8 encode at 1M values (4 MiB of fp32), "
        "single-threaded, timed as that benchmark times everything: a full `gc.collect()` "
        "right before each call (**cold**), and also back to back (**in cache**). Best of "
        f"{repeats} calls. ×copy = the cold copy's time / the part's cold time.",
        "",
        "| data | part | cold ms | in cache ms | ×copy (cold) |",
        "|---|---|---|---|---|",
    ]
    copies = {r.kind: r.cold_s for r in rows if r.part == COPY}
    for r in rows:
        lines.append(
            f"| {r.kind} | {r.part} | {r.cold_s * 1e3:.3f} | {r.hot_s * 1e3:.3f} "
            f"| {copies[r.kind] / r.cold_s:.2f}× |"
        )
    return lines


# --------------------------------------------------------------------------- table 3

WARM_UP = (
    "import time; t = time.perf_counter(); from shared.codec import api as codec; "
    "i, c = time.perf_counter(), time.process_time(); codec.warm_up(); "
    "print(i - t, time.perf_counter() - i, time.process_time() - c)"
)


def sources_stamp() -> list[int]:
    """Modification times of the codec's sources: Numba's cache is keyed on them."""
    sources = sorted((REPO / "shared" / "codec").glob("*.py"))
    return [path.stat().st_mtime_ns for path in sources]


def warm_up_runs() -> list[CompileRun]:
    """A cold and a cached process's ``codec.warm_up()``."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for what in ("cold: empty cache, every kernel compiles", "cached: the same directory"):
            out = subprocess.run(
                [sys.executable, "-c", WARM_UP],
                cwd=REPO,
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
            files = sum(len(f) for _, _, f in os.walk(cache))
            import_s, warm_up_s, cpu_s = map(float, out)
            runs.append(
                CompileRun(
                    what=what,
                    import_s=import_s,
                    warm_up_s=warm_up_s,
                    cpu_s=cpu_s,
                    cache_files=files,
                )
            )
            note(f"  warm_up {what}: {warm_up_s:.2f} s, CPU {cpu_s:.2f} s ({files} cache files)")
    return runs


def measure_compile() -> list[CompileRun]:
    """codec.warm_up() in fresh processes: an empty Numba cache, then the same cache (again,
    once, if the sources changed in between: that invalidates the cache)."""
    for _ in range(2):
        stamp = sources_stamp()
        runs = warm_up_runs()
        if sources_stamp() == stamp:
            break
        note("  the codec's sources changed during the runs; measuring again")
    return runs


def compile_table(runs: list[CompileRun]) -> list[str]:
    lines = [
        "`codec.warm_up()` in a fresh `python -c` process with `NUMBA_CACHE_DIR` pointed at a "
        "new empty directory, then again in another fresh process with the same directory "
        "(the same number of cache files after both: nothing compiled the second time).",
        "",
        "| Numba cache | import `shared.codec` s | `codec.warm_up()` s | its CPU s "
        "| files in the cache after |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.what} | {r.import_s:.2f} | {r.warm_up_s:.2f} | {r.cpu_s:.2f} | {r.cache_files} |"
        for r in runs
    ]
    return lines


# --------------------------------------------------------------------------- claims


def gain_share(upload: Upload, own: str, public: str, level: int) -> float:
    """The public row's CPU time minus the project's, as a share of the upload's link time."""
    return (upload.times[public] - upload.times[own]) / link_s(upload.model_dump(), level)


def claims(results: CodecPartsResults) -> list[Claim]:
    """What docs/CODEC.md says of these tables, checked on the stored figures."""
    uploads = results.uploads
    measured = bool(uploads)
    same = [
        u.checks.numpy_codes_identical
        and all(u.checks.payload_identical.values())
        and u.checks.decode_identical
        for u in uploads
    ]
    small = next((u for u in uploads if u.name == "small"), None)
    zstd_gaps = [
        abs(gain_share(u, own, public, level))
        for u in uploads
        for own, public, level in (("z1", "z1_np", 1), ("z-1", "z-1_np", -1), ("d", "d_pub", 1))
    ]
    hash_log = [u.times["z-1_plain"] / u.times["z-1"] for u in uploads]
    cold = next((r.warm_up_s for r in results.compile if r.what.startswith("cold")), None)
    cached = next((r.warm_up_s for r in results.compile if r.what.startswith("cached")), None)
    return [
        Claim(
            "the public routes (NumPy quantiser, python-zstandard) give the codec's codes, "
            "payload bytes (zstd 1 and −1) and decoded values, for every model",
            f"{sum(same)} of {len(same)} models" if measured else "not measured",
            all(same) if measured else None,
        ),
        at_most(
            "`jax.jit` quantiser: the same codes as the codec (codes differing, all models)",
            sum(u.checks.jax_codes_differing for u in uploads) if measured else None,
            0,
            "d",
        ),
        at_least(
            f"the Numba quantiser gains > {KEEP_GAIN:.0%} of a `small` upload's 1 Gbit/s link "
            "time over NumPy (docs/CODEC.md's rule for keeping it)",
            gain_share(small, "q_numba", "q_np", 1) if small else None,
            KEEP_GAIN,
            ".1%",
        ),
        at_most(
            "`shared.codec.zstd` compress (zstd 1, −1) and decompress cost what "
            f"python-zstandard's public calls cost, within {SAME_COST:.0%} of the link time "
            "(largest gap, all models)",
            max(zstd_gaps) if zstd_gaps else None,
            SAME_COST,
            ".2%",
        ),
        at_least(
            f"zstd −1 with the project's hash log is ≥ {HASH_LOG_SPEED_UP}× as fast as "
            "`ZstdCompressor(level=-1)` (slowest model)",
            min(hash_log) if hash_log else None,
            HASH_LOG_SPEED_UP,
            ".2f",
        ),
        at_most(
            f"Numba's cache: `codec.warm_up()` from the cache takes ≤ {CACHED_SHARE:.0%} of a "
            "cold compile",
            cached / cold if cold and cached is not None else None,
            CACHED_SHARE,
            ".1%",
        ),
    ]


# --------------------------------------------------------------------------- report


def render(results: CodecPartsResults, checked: list[Claim], path: Path) -> str:
    lines = [SECTION, "", results.provenance.line(path) + " Three tables.", ""]
    lines += parts_table(results.parts, results.repeats)
    lines += ["", "### The codec stack against public APIs, at the sizes learners upload", ""]
    lines += upload_tables([u.model_dump() for u in results.uploads], results.address_us)
    lines += ["", "### Numba compile: cold and cached", ""]
    lines += compile_table(results.compile)
    lines += ["", render_claims(checked)]
    return "\n".join(lines)


def report(results: CodecPartsResults, args: argparse.Namespace, path: Path) -> None:
    """Render the stored results, write the section when asked, exit on the claims."""
    checked = claims(results)
    publish(SECTION, render(results, checked, path), checked, args.write, args.quick)


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41, help="calls per figure (table 1)")
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated models of table 2"
    )
    parser.add_argument("--render", action="store_true", help="run nothing: render the stored")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 5 calls per figure, model small only"
    )
    args = parser.parse_args()
    path = results_path(NAME, args.quick)
    if args.render:
        if not path.exists():
            raise SystemExit(f"{path}: no stored results (run bench/codec_parts.py first)")
        report(CodecPartsResults.model_validate_json(path.read_text()), args, path)
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := [m for m in models if m not in MODELS]:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    if args.quick:
        args.repeats, models = 5, ["small"]
    elif args.write and (models != list(MODELS) or args.repeats != 41):
        parser.error("--write records the full benchmark; drop --models/--repeats")
    started = time.perf_counter()
    configuration = {"repeats": args.repeats, "models": models, "level": LEVEL, "block": BLOCK}
    provenance = Provenance.start(PROGRAM, configuration, path)
    note("Numba compile, cold and cached:")
    compiled = measure_compile()
    rounds = load_rounds(recapture=False)
    warm_up_codec()
    codec.warm_up()
    note("1. the parts of a 1M-value int8 encode:")
    parts_rows = measure_parts(rounds, args.repeats)
    note("2. the codec stack against public APIs:")
    address = address_us()
    uploads = [
        Upload.model_validate(measure_model(name, rounds, MODEL_REPEATS.get(name, 3)))
        for name in models
    ]
    provenance.seconds = round(time.perf_counter() - started, 1)
    results = CodecPartsResults(
        provenance=provenance,
        repeats=args.repeats,
        parts=parts_rows,
        uploads=uploads,
        address_us=address,
        compile=compiled,
    )
    save(path, results)
    report(results, args, path)


if __name__ == "__main__":
    main()
