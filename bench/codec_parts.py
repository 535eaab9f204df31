"""Where the time of one int8 encode at 1M values goes, beside the copy it is compared with.

``bench/codec.py`` reports int8 encode at 1M values (4 MiB of fp32) of real pseudo-gradients
near half the speed of ``np.copy``. This breaks that encode into its parts and times each one
the way ``bench/codec.py`` times everything (a full ``gc.collect()`` right before each call,
the collector off during it: cold caches), and again back to back (in cache):

* the copy (``np.copy``) and the whole encode (``codec.encode_flat``, zstd level -1);
* the quantiser alone (``quant.encode_blocks`` over the buffer, int8, block 256);
* a bare read of the same 4 MiB (``ndarray.max`` over its bits);
* zstd level -1 on the 1 MiB of codes (the codec's own ``shared.zstd.Compressor``), and on
  its first 1 KiB (the fixed cost of a cold call).

With ``--write`` the table and the command go into BENCHMARKS.md.

    .venv/bin/python bench/codec_parts.py --write      # ≈ 1 min
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from codec import SIZES, load_rounds, make_dataset, timed  # bench/codec.py
from codec import warm_up as warm_up_codec
from report import write_section

from shared import codec, quant, zstd

SECTION = "## Pseudo-gradient codec: the parts of a 1M-value int8 encode"
COMMAND = ".venv/bin/python bench/codec_parts.py --write"
BLOCK = 256
LEVEL = -1


def best(function: Callable[[], object], repeats: int, cold: bool) -> float:
    """Best time of ``repeats`` calls: each after a full collection (cold), or back to back."""
    if cold:
        return min(timed(function)[0] for _ in range(repeats))
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def parts(buffer: np.ndarray, layout: codec.Layout) -> dict[str, Callable[[], object]]:
    """The calls to time, by row label, on one data set's buffer."""
    blocks = buffer.size // BLOCK
    scales = np.empty(blocks, np.float32)
    codes = np.empty(blocks * BLOCK, np.uint8)
    no_residual = np.zeros(0, np.float32)
    quantise = partial(quant.encode_blocks, buffer, no_residual, False, 8, BLOCK, scales, codes)
    quantise()
    compressor = zstd.Compressor(LEVEL)
    frame = np.empty(zstd.compress_bound(codes.size), np.uint8)
    first_kib = codes[:1024].copy()
    config = codec.CodecConfig("int8", BLOCK, LEVEL, threads=0)
    return {
        "np.copy (the reference)": partial(np.copy, buffer),
        "whole encode (encode_flat, int8, zstd -1)": partial(
            codec.encode_flat, buffer, layout, config
        ),
        "quantiser alone (quant.encode_blocks)": quantise,
        "bare read of the 4 MiB (max over the bits)": buffer.view(np.uint32).max,
        "zstd -1 on the 1 MiB of codes": partial(compressor.compress_into, codes, frame),
        "zstd -1 on 1 KiB of codes": partial(compressor.compress_into, first_kib, frame),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41, help="calls per figure (best kept)")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    started = time.perf_counter()
    rounds = load_rounds(recapture=False)
    warm_up_codec()
    lines = [
        SECTION,
        "",
        f"`{COMMAND}` — the parts of `bench/codec.py`'s int8 encode at 1M values (4 MiB of fp32), "
        "single-threaded, timed as that benchmark times everything: a full `gc.collect()` "
        "right before each call (**cold**), and also back to back (**in cache**). Best of "
        f"{args.repeats} calls. ×copy = the cold copy's time / the part's cold time.",
        "",
        "| data | part | cold ms | in cache ms | ×copy (cold) |",
        "|---|---|---|---|---|",
    ]
    for kind in ("real", "gaussian"):
        ds = make_dataset("1M", kind, rounds)
        assert ds.buffer.size == SIZES["1M"]
        calls = parts(ds.buffer, ds.layout)
        cold = {label: best(call, args.repeats, cold=True) for label, call in calls.items()}
        hot = {label: best(call, args.repeats, cold=False) for label, call in calls.items()}
        copy = cold["np.copy (the reference)"]
        for label in calls:
            row = (
                f"| {kind} | {label} | {cold[label] * 1e3:.3f} | {hot[label] * 1e3:.3f} "
                f"| {copy / cold[label]:.2f}× |"
            )
            lines.append(row)
            print(row, flush=True)
    lines += ["", f"Whole run: {time.perf_counter() - started:.0f} s.", ""]
    table = "\n".join(lines)
    if args.write:
        write_section(SECTION, table)
    else:
        print(table)


if __name__ == "__main__":
    main()
