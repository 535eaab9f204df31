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

With ``--write`` the tables and the command go into BENCHMARKS.md.

    .venv/bin/python bench/codec_parts.py --write      # ≈ 3 min on 2 cores
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

import numpy as np
from codec import REPO, SIZES, load_rounds, make_dataset  # bench/codec.py
from codec import warm_up as warm_up_codec
from codec_routes import BLOCK, address_us, best
from codec_uploads import MODEL_REPEATS, MODELS, measure_model, upload_tables
from report import write_section

from shared.codec import api as codec
from shared.codec import quantize, zstd
from shared.codec.config import CodecConfig
from shared.codec.layout import Layout

SECTION = "## Pseudo-gradient codec: the parts of a 1M-value int8 encode"
LEVEL = -1


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


def parts_table(rounds: list[dict[str, np.ndarray]], repeats: int) -> list[str]:
    lines = [
        f"The parts of `bench/codec.py`'s int8 encode at 1M values (4 MiB of fp32), "
        "single-threaded, timed as that benchmark times everything: a full `gc.collect()` "
        "right before each call (**cold**), and also back to back (**in cache**). Best of "
        f"{repeats} calls. ×copy = the cold copy's time / the part's cold time.",
        "",
        "| data | part | cold ms | in cache ms | ×copy (cold) |",
        "|---|---|---|---|---|",
    ]
    for kind in ("real", "gaussian"):
        ds = make_dataset("1M", kind, rounds)
        assert ds.buffer.size == SIZES["1M"]
        calls = parts(ds.buffer, ds.layout)
        cold = {label: best(call, repeats, cold=True) for label, call in calls.items()}
        hot = {label: best(call, repeats, cold=False) for label, call in calls.items()}
        copy = cold["np.copy (the reference)"]
        for label in calls:
            row = (
                f"| {kind} | {label} | {cold[label] * 1e3:.3f} | {hot[label] * 1e3:.3f} "
                f"| {copy / cold[label]:.2f}× |"
            )
            lines.append(row)
            print(row, flush=True)
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


def warm_up_runs() -> list[tuple[str, float, float, float, int]]:
    """(what, import s, warm_up wall s, warm_up CPU s, cache files after) of a cold and a
    cached process."""
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
            runs.append((what, *map(float, out), files))
            print(f"  warm_up {what}: {out[1]} s, CPU {out[2]} s ({files} cache files)", flush=True)
    return runs


def compile_table() -> list[str]:
    """codec.warm_up() in fresh processes: an empty Numba cache, then the same cache (again,
    once, if the sources changed in between: that invalidates the cache)."""
    for _ in range(2):
        stamp = sources_stamp()
        runs = warm_up_runs()
        if sources_stamp() == stamp:
            break
        print("  the codec's sources changed during the runs; measuring again", flush=True)
    lines = [
        "`codec.warm_up()` in a fresh `python -c` process with `NUMBA_CACHE_DIR` pointed at a "
        "new empty directory, then again in another fresh process with the same directory "
        "(the same number of cache files after both: nothing compiled the second time).",
        "",
        "| Numba cache | import `shared.codec` s | `codec.warm_up()` s | its CPU s "
        "| files in the cache after |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {w} | {i:.2f} | {s:.2f} | {c:.2f} | {f} |" for w, i, s, c, f in runs]
    return lines


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41, help="calls per figure (table 1)")
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated models of table 2"
    )
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 5 calls per figure, model small only"
    )
    args = parser.parse_args()
    if args.quick:
        if args.write:
            parser.error("--quick does not write BENCHMARKS.md")
        args.repeats, args.models = 5, "small"
    started = time.perf_counter()
    command = " ".join([".venv/bin/python bench/codec_parts.py", *sys.argv[1:]])
    print("Numba compile, cold and cached:", flush=True)
    compiled = compile_table()
    rounds = load_rounds(recapture=False)
    warm_up_codec()
    codec.warm_up()
    print("1. the parts of a 1M-value int8 encode:", flush=True)
    lines = [SECTION, "", f"`{command}` — three tables, {os.cpu_count()} shared cores.", ""]
    lines += parts_table(rounds, args.repeats)
    print("2. the codec stack against public APIs:", flush=True)
    address = address_us()
    results = [
        measure_model(name, rounds, MODEL_REPEATS.get(name, 3)) for name in args.models.split(",")
    ]
    lines += ["", "### The codec stack against public APIs, at the sizes learners upload", ""]
    lines += upload_tables(results, address)
    lines += ["", "### Numba compile: cold and cached", ""]
    lines += compiled
    lines += ["", f"Whole run: {time.perf_counter() - started:.0f} s.", ""]
    table = "\n".join(lines)
    if args.write:
        write_section(SECTION, table)
    else:
        print(table)


if __name__ == "__main__":
    main()
