"""Where the time of an int8 encode goes, and what the same work costs with public APIs only.

Three tables, one BENCHMARKS.md section:

1. **The parts of a 1M-value int8 encode.** ``bench/codec.py`` reports int8 encode at 1M
   values (4 MiB of fp32) of real pseudo-gradients near half the speed of ``np.copy``. This
   breaks that encode into its parts and times each one the way ``bench/codec.py`` times
   everything (a full ``gc.collect()`` right before each call, the collector off during it:
   cold caches), and again back to back (in cache):

   * the copy (``np.copy``) and the whole encode (``codec.encode_flat``, zstd level -1);
   * the quantiser alone (``quant.encode_blocks`` over the buffer, int8, block 256);
   * a bare read of the same 4 MiB (``ndarray.max`` over its bits);
   * zstd level -1 on the 1 MiB of codes (the codec's own ``shared.zstd.Compressor``), and
     on its first 1 KiB (the fixed cost of a cold call).

2. **The codec stack against public APIs, at the sizes learners upload.** One upload of the
   whole ``small``, ``medium`` and ``large`` model (one fragment, the model's own tensor
   shapes, int8, block 256, ``threads=0``), encoded and decoded by the project's codec
   (Numba kernels; zstd through ``shared.zstd``) and by the same work written with
   public APIs only: a NumPy or a ``jax.jit`` quantiser giving the same codes and scales in
   the same segment layout, python-zstandard's public ``ZstdCompressor`` /
   ``ZstdDecompressor`` (same level; at level -1 also with the project's hash log through
   ``ZstdCompressionParameters``), the same XXH3 checksums and the same decode-side checks.
   Each time is also given as a share of the upload's transfer time at 1 Gbit/s (payload
   bytes × 8 / 10^9 s), and a second table gives the gain of each compiled piece, and of
   ``shared.zstd``'s one payload buffer, over its public equivalent in the same terms. The
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
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from functools import partial

import numpy as np
import xxhash
import zstandard
from codec import REPO, SIZES, load_rounds, make_dataset, timed  # bench/codec.py
from codec import warm_up as warm_up_codec
from report import write_section

from shared import codec, quant, zstd

SECTION = "## Pseudo-gradient codec: the parts of a 1M-value int8 encode"
BLOCK = 256
LEVEL = -1
MODELS = ("small", "medium", "large")
# Calls per figure (best kept) in table 2, by model: fewer where one call takes seconds.
MODEL_REPEATS = {"small": 15, "medium": 9, "large": 6}
LINK_BITS_PER_S = 1e9
QMAX = np.float32(127)
F32_MAX = float(np.finfo(np.float32).max)
# The blocks the project's kernels send down their exact float64 path (shared/quant.py).
TINY, HUGE = np.float32(2.0**-100), np.float32(2.0**120)
UNIT_BYTES = 4 + BLOCK  # one int8 block: its fp32 scale and its codes


def jax_repeats(repeats: int) -> int:
    """Calls per figure of the ``jax.jit`` rows (the slowest by far) in table 2."""
    return max(2, repeats // 3)


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


def timed_cpu(
    function: Callable[[], object], clock: Callable[[], float], prime: int
) -> tuple[float, float]:
    """Wall and CPU time (``clock``) of one call, timed as :func:`codec.timed` times it: a
    full collection first, the collector off during the call; the result is dropped.

    First ``prime`` bytes are faulted in and freed, so that the call's large allocations find
    free huge pages: otherwise whichever call came first after memory was fragmented paid
    for the kernel's compaction (in system time, several times the call's own)."""
    buffer = np.empty(prime, np.uint8)
    buffer[::4096] = 1
    del buffer
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), clock()
        function()
        return time.perf_counter() - wall, clock() - cpu
    finally:
        gc.enable()


# --------------------------------------------------------------------------- table 1


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


# --------------------------------------------------------------------------- table 2: data


def model_layout(name: str) -> codec.Layout:
    """The layout of one upload of model ``name`` as a learner with one fragment sends it
    (``services/learner/core.py``): its tensors' names and shapes."""
    import jax

    from shared import model
    from shared.fragments import plan_fragments

    cfg = model.get_config(name)
    params = jax.eval_shape(partial(model.init_params, cfg), jax.random.PRNGKey(0))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    shapes = {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in leaves}
    assert sum(map(np.prod, shapes.values())) == model.param_count(params)
    (fragment,) = plan_fragments(shapes, 1).fragments
    return codec.Layout({p.key: shapes[p.name][0 if p.layer is None else 1 :] for p in fragment})


def real_values(layout: codec.Layout, rounds: list[dict[str, np.ndarray]]) -> tuple:
    """A flat buffer for ``layout`` filled with the captured real pseudo-gradients, and what
    was put there: the first round itself where the layout is the captured model's, else
    the values of all rounds (sorted names, round by round) tiled to the size."""
    values = np.empty(layout.size, np.float32)
    first = rounds[0]
    if set(layout.names) == set(first) and all(
        first[n].shape == s for n, s in zip(layout.names, layout.shapes, strict=True)
    ):
        for name, view in layout.views(values).items():
            view[...] = first[name]
        return values, "the first captured round itself"
    source = np.concatenate([r[n].reshape(-1) for r in rounds for n in sorted(r)])
    for lo in range(0, values.size, source.size):
        chunk = values[lo : lo + source.size]
        chunk[:] = source[: chunk.size]
    return values, f"the captured rounds' values tiled ×{values.size / source.size:.1f}"


# --------------------------------------------------------------------------- public APIs


def public_compressor(level: int, hash_log: bool) -> zstandard.ZstdCompressor:
    """python-zstandard's public compressor writing frames as ``shared.zstd`` does (content
    size, no checksum); with ``hash_log``, also the hash log the project uses at fast levels."""
    if not hash_log:
        return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    params = zstandard.ZstdCompressionParameters.from_level(
        level, hash_log=zstd.FAST_HASH_LOG, write_checksum=0, write_content_size=1
    )
    return zstandard.ZstdCompressor(compression_params=params)


def numpy_quantise_blocks(x: np.ndarray, scales: np.ndarray, codes: np.ndarray, tmp: np.ndarray):
    """int8 blockwise absmax of the rows of ``x`` (one block each) into ``scales`` and int8
    ``codes``, with NumPy only: the project's math (``scale = absmax / 127``, codes
    ``rint(x · (127 / absmax))``, zero blocks all zero). ``tmp``: float32 scratch like ``x``.

    Blocks the project sends down its exact float64 path (absmax below 2^-100 or above 2^120)
    are refused rather than handled; real pseudo-gradients have none.
    """
    np.abs(x, out=tmp)
    absmax = tmp.max(axis=1)
    if not np.isfinite(absmax).all():
        raise ValueError("NaN/Inf in a pseudo-gradient")
    if ((absmax > HUGE) | ((absmax < TINY) & (absmax > 0))).any():
        raise NotImplementedError("a block of (near-)subnormal or huge values")
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = QMAX / absmax
        np.multiply(x, inv[:, None], out=tmp)
    np.rint(tmp, out=tmp)
    zero = absmax == 0
    if zero.any():
        tmp[zero] = 0
    np.copyto(codes, tmp, casting="unsafe")
    np.divide(absmax, QMAX, out=scales)


class NumpyQuantiser:
    """The raw segments of ``codec.encode_flat`` (int8): each segment's fp32 scales, then its
    codes, each tensor cut into its own zero-padded blocks, with NumPy only."""

    def __init__(self, values: np.ndarray, layout: codec.Layout, plan) -> None:
        self.values = values
        self.offsets = layout.offsets
        self.plan = plan
        self.tmp = np.empty((plan.segment, BLOCK), np.float32)
        self.pad = np.zeros((1, BLOCK), np.float32)

    def segment(self, pieces: np.ndarray, raw: np.ndarray) -> None:
        """Quantise one segment (``pieces`` of the plan) into ``raw``."""
        m = raw.size // UNIT_BYTES
        scales = raw[: 4 * m].view(np.float32)
        codes = raw[4 * m :].view(np.int8).reshape(m, BLOCK)
        for tensor, lo, hi, first, units in pieces.tolist():
            x = self.values[self.offsets[tensor] + lo : self.offsets[tensor] + hi]
            full = x.size // BLOCK
            if full:
                rows = slice(first, first + full)
                blocks = x[: full * BLOCK].reshape(full, BLOCK)
                numpy_quantise_blocks(blocks, scales[rows], codes[rows], self.tmp[:full])
            if full < units:  # the tensor's last, zero-padded block
                self.pad[0, x.size - full * BLOCK :] = 0
                self.pad[0, : x.size - full * BLOCK] = x[full * BLOCK :]
                rows = slice(first + full, first + units)
                numpy_quantise_blocks(self.pad, scales[rows], codes[rows], self.tmp[:1])

    def __call__(self) -> np.ndarray:
        """Every segment, back to back (the codec's raw layout)."""
        raw = np.empty(self.plan.raw_size, np.uint8)
        end = 0
        for pieces, raw_bytes in self.plan.jobs:
            self.segment(pieces, raw[end : end + raw_bytes])
            end += raw_bytes
        return raw


def jax_quantiser(layout: codec.Layout, plan) -> Callable:
    """A ``jax.jit`` function: flat float32 values -> (the codec's raw segments as uint8, all
    values finite), the same math as :func:`numpy_quantise_blocks`."""
    import jax
    import jax.numpy as jnp

    segment = plan.segment

    def quantise(values):
        blocks = []
        for offset, size in zip(layout.offsets, layout.sizes, strict=True):
            units = -(-size // BLOCK)
            x = values[offset : offset + size]
            if units * BLOCK != size:
                x = jnp.pad(x, (0, units * BLOCK - size))
            blocks.append(x.reshape(units, BLOCK))
        x = jnp.concatenate(blocks)
        absmax = jnp.max(jnp.abs(x), axis=1)
        inv = jnp.float32(127) / absmax
        codes = jnp.where(absmax[:, None] > 0, jnp.rint(x * inv[:, None]), 0).astype(jnp.int8)
        scales = absmax / jnp.float32(127)
        parts = []
        for lo in range(0, x.shape[0], segment):
            hi = min(lo + segment, x.shape[0])
            parts.append(jax.lax.bitcast_convert_type(scales[lo:hi], jnp.uint8).reshape(-1))
            parts.append(jax.lax.bitcast_convert_type(codes[lo:hi], jnp.uint8).reshape(-1))
        return jnp.concatenate(parts), jnp.isfinite(absmax).all()

    return jax.jit(quantise)


def public_frames(raw: np.ndarray, plan, cctx: zstandard.ZstdCompressor, join: bool):
    """Each raw segment compressed by the public API (a fresh ``bytes`` per frame); the
    frames joined with ``b"".join`` (``join``), or each copied at once into one NumPy buffer
    of the size ``project_frames`` allocates (NumPy asks for huge pages)."""
    if join:
        frames, end = [], 0
        for _, raw_bytes in plan.jobs:
            frames.append(cctx.compress(raw[end : end + raw_bytes]))
            end += raw_bytes
        return b"".join(frames)
    out = np.empty(plan.total_bound, np.uint8)
    src = dst = 0
    for _, raw_bytes in plan.jobs:
        frame = cctx.compress(raw[src : src + raw_bytes])
        out[dst : dst + len(frame)] = np.frombuffer(frame, np.uint8)
        src, dst = src + raw_bytes, dst + len(frame)
    return out[:dst]


class PublicPayload:
    """The frames of one payload, compressed by the public API and each copied at once into
    one NumPy buffer sized as the codec sizes its own (libzstd's documented bound per frame),
    with their sizes and XXH3-64 checksums."""

    def __init__(self, plan) -> None:
        self.out = np.empty(plan.total_bound, np.uint8)
        self.end = 0
        self.sizes: list[int] = []
        self.checksums: list[int] = []

    def add(self, cctx: zstandard.ZstdCompressor, raw: np.ndarray) -> None:
        frame = cctx.compress(raw)
        self.out[self.end : self.end + len(frame)] = np.frombuffer(frame, np.uint8)
        self.end += len(frame)
        self.sizes.append(len(frame))
        self.checksums.append(xxhash.xxh3_64_intdigest(frame))

    def result(self) -> tuple[memoryview, list[int], list[int]]:
        return memoryview(self.out)[: self.end], self.sizes, self.checksums


def public_encode(
    quantise_segment: Callable, plan, cctx: zstandard.ZstdCompressor, scratch: np.ndarray
) -> tuple[memoryview, list[int], list[int]]:
    """encode_flat's work with public APIs: per segment quantise into a reused ``scratch``,
    compress, XXH3 the frame (see :class:`PublicPayload`)."""
    payload = PublicPayload(plan)
    for pieces, raw_bytes in plan.jobs:
        raw = scratch[:raw_bytes]
        quantise_segment(pieces, raw)
        payload.add(cctx, raw)
    return payload.result()


def jax_encode(jitted: Callable, values, plan, cctx: zstandard.ZstdCompressor) -> tuple:
    """As :func:`public_encode`, quantised in one ``jax.jit`` call."""
    raw, finite = jitted(values)
    if not bool(finite):
        raise ValueError("NaN/Inf in a pseudo-gradient")
    raw = np.asarray(raw)
    payload, end = PublicPayload(plan), 0
    for _, raw_bytes in plan.jobs:
        payload.add(cctx, raw[end : end + raw_bytes])
        end += raw_bytes
    return payload.result()


def numpy_dequantise(raw: np.ndarray, out: np.ndarray) -> None:
    """One raw segment's codes × scales into ``out`` (float32), with the project's checks:
    scales finite, not negative, not so large that 127 × scale overflows; no -128 code."""
    m = raw.size // UNIT_BYTES
    scales = raw[: 4 * m].view(np.float32)
    codes = raw[4 * m :].view(np.int8).reshape(m, BLOCK)
    if (scales.view(np.uint32) >= np.uint32(0x7F800000)).any() or (scales > F32_MAX / 127).any():
        raise ValueError("bad scale")
    if codes.min() == -128:
        raise ValueError("bad code")
    np.multiply(codes, scales[:, None], out=out.reshape(m, BLOCK))


def public_decode(payload, description: dict, dctx: zstandard.ZstdDecompressor) -> dict:
    """decode_tensors' work with public APIs: per frame check XXH3, decompress (a fresh
    ``bytes``), dequantise with NumPy; the tensors as views of one output buffer."""
    payload = memoryview(payload)
    segment = description["segment"]
    total = description["raw_size"] // UNIT_BYTES
    values = np.empty(total * BLOCK, np.float32)
    end = 0
    for index, (size, checksum) in enumerate(
        zip(description["frames"], description["checksums"], strict=True)
    ):
        frame = payload[end : end + size]
        end += size
        if xxhash.xxh3_64_intdigest(frame) != checksum:
            raise ValueError("checksum")
        first = index * segment
        units = min(segment, total - first)
        if zstandard.frame_content_size(frame) != units * UNIT_BYTES:  # before allocating
            raise ValueError("frame size")
        raw = np.frombuffer(dctx.decompress(frame, allow_extra_data=False), np.uint8)
        if raw.size != units * UNIT_BYTES:
            raise ValueError("frame size")
        numpy_dequantise(raw, values[first * BLOCK : (first + units) * BLOCK])
    out, start = {}, 0
    for name, shape, _ in description["tensors"]:
        size = int(np.prod(shape))
        out[name] = values[start : start + size].reshape(shape)
        start += -(-size // BLOCK) * BLOCK
    return out


# --------------------------------------------------------------------------- table 2: rows


def project_quantise(values: np.ndarray, plan) -> np.ndarray:
    """The codec's Numba kernel over every segment (as encode_flat calls it), into one buffer."""
    raw = np.empty(plan.raw_size, np.uint8)
    base, end = quant.address(values), 0
    for pieces, raw_bytes in plan.jobs:
        offsets = plan.byte_offsets
        quant.encode_segment(
            base, offsets, offsets, pieces, False, 8, BLOCK, raw[end : end + raw_bytes]
        )
        end += raw_bytes
    return raw


def project_frames(raw: np.ndarray, plan, compressor: zstd.Compressor) -> np.ndarray:
    """Each raw segment compressed by ``shared.zstd`` straight into one payload buffer."""
    out = np.empty(plan.total_bound, np.uint8)
    src = dst = 0
    for _, raw_bytes in plan.jobs:
        dst += compressor.compress_into(raw[src : src + raw_bytes], out[dst:])
        src += raw_bytes
    return out[:dst]


def split(payload, description: dict) -> list[memoryview]:
    view, end, frames = memoryview(payload), 0, []
    for size in description["frames"]:
        frames.append(view[end : end + size])
        end += size
    return frames


def project_decompress(frames: list[memoryview], plan) -> None:
    for frame, (_, raw_bytes) in zip(frames, plan.jobs, strict=True):
        zstd.decompress(frame, raw_bytes)


def public_decompress(frames: list[memoryview], dctx: zstandard.ZstdDecompressor) -> None:
    for frame in frames:
        dctx.decompress(frame, allow_extra_data=False)


def dequantise(raw: np.ndarray, plan, kernel: bool) -> np.ndarray:
    """Every raw segment decoded into one fresh float32 buffer: the codec's Numba kernel
    (``kernel``) or :func:`numpy_dequantise`."""
    out = np.empty(plan.raw_size // UNIT_BYTES * BLOCK, np.float32)
    src = dst = 0
    for _, raw_bytes in plan.jobs:
        m = raw_bytes // UNIT_BYTES
        seg, values = raw[src : src + raw_bytes], out[dst : dst + m * BLOCK]
        if kernel:
            bad = quant.decode_blocks(seg[4 * m :], seg[: 4 * m].view(np.float32), 8, BLOCK, values)
            if bad >= 0:
                raise ValueError("bad block")
        else:
            numpy_dequantise(seg, values)
        src, dst = src + raw_bytes, dst + m * BLOCK
    return out


def address_us() -> float:
    """µs per call of quant.address (CPU time, in cache)."""
    call = partial(quant.address, np.zeros(1000, np.float32))
    n = 20000
    return min(timeit.repeat(call, time.thread_time, number=n, repeat=5)) / n * 1e6


ROWS = {
    "enc1": "**encode, zstd 1: project** (`encode_flat`: Numba + `shared.zstd`)",
    "enc1_np": "encode, zstd 1: public (NumPy quantiser + `ZstdCompressor`)",
    "enc1_jax": "encode, zstd 1: public (`jax.jit` quantiser + `ZstdCompressor`)",
    "enc-1": "**encode, zstd −1: project**",
    "enc-1_np": "encode, zstd −1: public (NumPy + `ZstdCompressor`, hash log 10)",
    "dec": "**decode: project** (`decode_tensors`)",
    "dec_np": "decode: public (`ZstdDecompressor` + NumPy)",
    "q_numba": "quantise only: Numba (`quant.encode_segment`)",
    "q_np": "quantise only: NumPy",
    "q_jax": "quantise only: `jax.jit`, from the NumPy buffer",
    "q_jax_dev": "quantise only: `jax.jit`, input already a JAX array",
    "z1": "compress only, zstd 1: `shared.zstd` (`compress_into` the payload buffer)",
    "z1_np": "compress only, zstd 1: `ZstdCompressor`, frames copied into one NumPy buffer",
    "z1_join": "compress only, zstd 1: `ZstdCompressor`, frames joined (`b''.join`)",
    "z-1": "compress only, zstd −1: `shared.zstd` (hash log 10)",
    "z-1_np": "compress only, zstd −1: `ZstdCompressor`, hash log 10, one NumPy buffer",
    "z-1_join": "compress only, zstd −1: `ZstdCompressor`, hash log 10, `b''.join`",
    "z-1_plain": "compress only, zstd −1: `ZstdCompressor(level=-1)`, one NumPy buffer",
    "d": "decompress only: `shared.zstd.decompress` (with its checks)",
    "d_pub": "decompress only: `ZstdDecompressor.decompress`",
    "dq_numba": "dequantise only: Numba (`quant.decode_blocks`)",
    "dq_np": "dequantise only: NumPy (same checks)",
}
# (piece, project row, public row, payload level whose transfer time it is compared with)
GAINS = [
    ("Numba quantiser vs NumPy", "q_numba", "q_np", 1),
    ("Numba quantiser vs `jax.jit` from the NumPy buffer", "q_numba", "q_jax", 1),
    ("Numba quantiser vs `jax.jit` on a JAX array", "q_numba", "q_jax_dev", 1),
    ("Numba dequantiser vs NumPy", "dq_numba", "dq_np", 1),
    ("`shared.zstd` compress, zstd 1, vs `ZstdCompressor` into one NumPy buffer", "z1", "z1_np", 1),
    ("`shared.zstd` compress, zstd 1, vs `ZstdCompressor` + `b''.join`", "z1", "z1_join", 1),
    ("`shared.zstd` compress, zstd −1, vs `ZstdCompressor` into one buffer", "z-1", "z-1_np", -1),
    ("`shared.zstd` compress, zstd −1, vs `ZstdCompressor` + `b''.join`", "z-1", "z-1_join", -1),
    ("`shared.zstd` decompress vs `ZstdDecompressor.decompress`", "d", "d_pub", 1),
    ("whole encode, zstd 1, vs public NumPy route", "enc1", "enc1_np", 1),
    ("whole encode, zstd 1, vs public `jax.jit` route", "enc1", "enc1_jax", 1),
    ("whole encode, zstd −1, vs public NumPy route", "enc-1", "enc-1_np", -1),
    ("whole decode vs public route", "dec", "dec_np", 1),
]


def measure_model(name: str, rounds, repeats: int) -> dict:
    """Checks, then the best cold time of every row of table 2 for one model's upload."""
    import jax

    layout = model_layout(name)
    values, filled = real_values(layout, rounds)
    plan = codec._plan("int8", BLOCK, layout)
    config = {lv: codec.CodecConfig("int8", BLOCK, lv, threads=0) for lv in (1, -1)}
    cctx = {1: public_compressor(1, False), -1: public_compressor(-1, True)}
    cctx_plain = public_compressor(-1, False)
    dctx = zstandard.ZstdDecompressor()
    numpy_q = NumpyQuantiser(values, layout, plan)
    # Reused segment scratch (as the codec reuses its own), its pages mapped before timing.
    scratch = np.zeros(max(n for _, n in plan.jobs), np.uint8)
    jitted = jax_quantiser(layout, plan)

    # Same work: the codes, scales, payloads and decoded values of both routes are compared.
    started = time.perf_counter()
    jax.block_until_ready(jitted(values))
    compile_s = time.perf_counter() - started
    raw = project_quantise(values, plan)
    same_numpy = np.array_equal(raw, numpy_q())
    raw_jax = np.asarray(jitted(values)[0])
    deq = dequantise(raw, plan, kernel=True)
    deq_jax = dequantise(raw_jax, plan, kernel=False)
    (scales, codes), (scales_jax, codes_jax) = split_raw(raw, plan), split_raw(raw_jax, plan)
    steps = np.repeat(scales, BLOCK)
    jax_steps = float(np.max(np.abs(deq - deq_jax) / np.where(steps > 0, steps, 1)))
    scales_jax_differing = int(np.count_nonzero(scales != scales_jax))
    scales_jax_ulps = int(np.max(np.abs(scales.view(np.int32) - scales_jax.view(np.int32))))
    codes_jax_differing = int(np.count_nonzero(codes != codes_jax))
    payload, description = {}, {}
    for lv in (1, -1):
        payload[lv], description[lv], _ = codec.encode_flat(values, layout, config[lv])
    public = {lv: public_encode(numpy_q.segment, plan, cctx[lv], scratch) for lv in (1, -1)}
    same_payload = {lv: bytes(payload[lv]) == bytes(public[lv][0]) for lv in (1, -1)}
    same_jax_payload = bytes(jax_encode(jitted, values, plan, cctx[1])[0]) == bytes(payload[1])
    plain = public_frames(raw, plan, cctx_plain, join=True)
    decoded = codec.decode_tensors(payload[1], description[1])
    decoded_pub = public_decode(payload[1], description[1], dctx)
    same_decode = all(np.array_equal(decoded[k], decoded_pub[k]) for k in decoded)
    blocks = scales.size
    del decoded, decoded_pub, deq, deq_jax, steps, raw_jax, public
    del scales, codes, scales_jax, codes_jax
    process = time.process_time()
    wall = time.perf_counter()
    jax.block_until_ready(jitted(values))
    jax_cpu = (time.process_time() - process) / (time.perf_counter() - wall)
    on_jax = jax.device_put(values)

    frames = split(payload[1], description[1])
    compressors = {1: zstd.Compressor(1), -1: zstd.Compressor(-1)}
    calls = {
        "enc1": partial(codec.encode_flat, values, layout, config[1]),
        "enc1_np": partial(public_encode, numpy_q.segment, plan, cctx[1], scratch),
        "enc1_jax": partial(jax_encode, jitted, values, plan, cctx[1]),
        "enc-1": partial(codec.encode_flat, values, layout, config[-1]),
        "enc-1_np": partial(public_encode, numpy_q.segment, plan, cctx[-1], scratch),
        "dec": partial(codec.decode_tensors, payload[1], description[1]),
        "dec_np": partial(public_decode, payload[1], description[1], dctx),
        "q_numba": partial(project_quantise, values, plan),
        "q_np": numpy_q,
        "q_jax": lambda: jax.block_until_ready(jitted(values)),
        "q_jax_dev": lambda: jax.block_until_ready(jitted(on_jax)),
        "z1": partial(project_frames, raw, plan, compressors[1]),
        "z1_np": partial(public_frames, raw, plan, cctx[1], join=False),
        "z1_join": partial(public_frames, raw, plan, cctx[1], join=True),
        "z-1": partial(project_frames, raw, plan, compressors[-1]),
        "z-1_np": partial(public_frames, raw, plan, cctx[-1], join=False),
        "z-1_join": partial(public_frames, raw, plan, cctx[-1], join=True),
        "z-1_plain": partial(public_frames, raw, plan, cctx_plain, join=False),
        "d": partial(project_decompress, frames, plan),
        "d_pub": partial(public_decompress, frames, dctx),
        "dq_numba": partial(dequantise, raw, plan, True),
        "dq_np": partial(dequantise, raw, plan, False),
    }
    assert calls.keys() == ROWS.keys()
    prime = values.nbytes + plan.raw_size + (64 << 20)  # more than any row allocates
    times = dict.fromkeys(calls, float("inf"))
    walls = dict.fromkeys(calls, float("inf"))
    for repeat in range(repeats):  # interleaved, so that a noisy moment hits every row alike
        for key, call in calls.items():
            if "jax" not in key or repeat < jax_repeats(repeats):
                # XLA runs on threads of its own; everything else on this one.
                clock = time.process_time if "jax" in key else time.thread_time
                wall, cpu = timed_cpu(call, clock, prime)
                times[key], walls[key] = min(times[key], cpu), min(walls[key], wall)
    result = {
        "name": name,
        "params": layout.size,
        "tensors": len(layout.names),
        "segments": len(plan.jobs),
        "filled": filled,
        "repeats": repeats,
        "payload": {lv: len(payload[lv]) for lv in (1, -1)},
        "plain_-1": len(plain),
        "times": times,
        "walls": walls,
        "checks": {
            "numpy_codes_identical": bool(same_numpy),
            "jax_codes_differing": codes_jax_differing,
            "jax_scales_differing": scales_jax_differing,
            "jax_scales_max_ulps": scales_jax_ulps,
            "jax_max_steps": jax_steps,
            "payload_identical": same_payload,
            "jax_payload_identical": bool(same_jax_payload),
            "decode_identical": bool(same_decode),
            "jax_compile_s": compile_s,
            "jax_cpu_per_wall": jax_cpu,
            "blocks": blocks,
        },
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("times", "walls")}), flush=True)
    for key, label in ROWS.items():
        link = link_s(result, -1 if "-1" in key else 1)
        print(
            f"  {name} {label}: CPU {times[key] * 1e3:.2f} ms = {times[key] / link:.1%}, "
            f"wall {walls[key] * 1e3:.2f} ms",
            flush=True,
        )
    return result


def split_raw(raw: np.ndarray, plan) -> tuple[np.ndarray, np.ndarray]:
    """The scales and the codes of every block of the raw segments, each in block order."""
    scales, codes, src = [], [], 0
    for _, raw_bytes in plan.jobs:
        m = raw_bytes // UNIT_BYTES
        scales.append(raw[src : src + 4 * m].view(np.float32))
        codes.append(raw[src + 4 * m : src + raw_bytes])
        src += raw_bytes
    return np.concatenate(scales), np.concatenate(codes)


def link_s(result: dict, level: int) -> float:
    """The upload's transfer time at 1 Gbit/s: its payload bytes × 8 / 10^9."""
    return result["payload"][level] * 8 / LINK_BITS_PER_S


def ms(seconds: float) -> str:
    v = seconds * 1e3
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def share(seconds: float, link: float) -> str:
    v = 100 * seconds / link
    return f"{v:.0f}%" if abs(v) >= 10 else f"{v:.1f}%" if abs(v) >= 1 else f"{v:.2f}%"


def upload_tables(results: list[dict], address: float) -> list[str]:
    heads = " | ".join(f"{r['name']} CPU ms | wall ms | % of link" for r in results)
    bar = "|---|" + "---|---|---|" * len(results)
    lines = [
        "One upload of the whole model (one fragment: the model's own tensor shapes), int8, "
        "block 256, `threads=0`, of real pseudo-gradients (the captured `small` rounds of "
        "`bench/codec.py`: "
        + "; ".join(f"{r['name']}: {r['filled']}" for r in results)
        + "). Each figure is the best of "
        + ", ".join(
            f"{r['repeats']} ({r['name']}; {jax_repeats(r['repeats'])} for `jax.jit` rows)"
            for r in results
        )
        + " cold calls (a full `gc.collect()` before each, and a buffer larger than the call "
        "allocates faulted in and freed, so that no call pays for the kernel compacting "
        "memory into huge pages), the rows interleaved. **CPU ms** "
        "is the CPU time of the calling thread (every row runs on it alone, `threads=0`), or of "
        "the whole process for `jax.jit` rows (XLA runs on threads of its own): on this "
        "shared machine other work delays a call's wall time (**wall ms**) but not its CPU "
        "time, and on an idle core the two agree. **% of link** = CPU time / the upload's "
        "transfer time at 1 Gbit/s (payload bytes × 8 / 10^9 s; the zstd −1 payload for −1 "
        "rows).",
        "",
        "**Public routes** (python-zstandard "
        f"{zstandard.__version__}, `{zstandard.backend}` backend, libzstd "
        f"{'.'.join(map(str, zstandard.ZSTD_VERSION))}): a NumPy (or `jax.jit`) int8 "
        "blockwise-absmax quantiser writes the codec's raw segments (scales, then codes; "
        "each tensor in its own zero-padded blocks); each segment is compressed by "
        "`ZstdCompressor(level=…, write_checksum=False, write_content_size=True)` (at −1 "
        "`ZstdCompressor(compression_params=ZstdCompressionParameters.from_level(-1, "
        "hash_log=10, …))`, the project's hash log, unless the row says otherwise) and "
        "copied into one NumPy payload buffer; XXH3-64 of each frame. Decode: XXH3 check, "
        "`ZstdDecompressor().decompress` per frame, NumPy dequantisation with the codec's "
        "checks (finite, non-negative scales; no −128 code) into one output buffer, after "
        "checking each frame's declared content size and with `allow_extra_data=False` (no "
        "bytes after the frame), as the codec checks them.",
        "",
        "| model | values | tensors | frames | fp32 MB | payload MB, zstd 1 | link ms "
        "| payload MB, zstd −1 | link ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['name']} | {r['params']:,} | {r['tensors']} | {r['segments']} "
        f"| {r['params'] * 4 / 1e6:.1f} | {r['payload'][1] / 1e6:.2f} | {ms(link_s(r, 1))} "
        f"| {r['payload'][-1] / 1e6:.2f} | {ms(link_s(r, -1))} |"
        for r in results
    ]
    lines += ["", f"| operation | {heads} |", bar]
    for key, label in ROWS.items():
        lv = -1 if "-1" in key else 1
        cells = " | ".join(
            f"{ms(r['times'][key])} | {ms(r['walls'][key])} "
            f"| {share(r['times'][key], link_s(r, lv))}"
            for r in results
        )
        lines.append(f"| {label} | {cells} |")
    lines += [
        "",
        "Gain of each compiled piece, and of `shared.zstd` over plain public calls, = public "
        "CPU time − project CPU time (positive: the project's piece is faster), in ms and as a "
        "share of the upload's 1 Gbit/s transfer time.",
        "",
        "| piece | " + " | ".join(f"{r['name']} gain ms | % of link" for r in results) + " |",
        "|---|" + "---|---|" * len(results),
    ]
    for label, own, public, lv in GAINS:
        cells = " | ".join(
            f"{ms(r['times'][public] - r['times'][own])} "
            f"| {share(r['times'][public] - r['times'][own], link_s(r, lv))}"
            for r in results
        )
        lines.append(f"| {label} | {cells} |")
    calls = ", ".join(
        f"{r['name']}: {(1 + r['tensors']) * address * 1e-3:.3f} ms, "
        f"{share((1 + r['tensors']) * address * 1e-6, link_s(r, 1))} of link"
        for r in results
    )
    lines += [
        "",
        f"`quant.address` (`ndarray.ctypes.data`): {address:.2f} µs a call (CPU time, best of "
        "5 × 20,000 calls, in cache). `encode_flat` calls it once per upload, plus once per "
        f"tensor with error feedback: at most {calls}.",
        "",
        "Checks (before timing): "
        + "; ".join(
            f"{r['name']}: NumPy raw segments "
            + ("identical" if r["checks"]["numpy_codes_identical"] else "DIFFERENT")
            + ", NumPy-route payloads "
            + ("identical" if all(r["checks"]["payload_identical"].values()) else "DIFFERENT")
            + " (zstd 1 and −1); `jax.jit` codes differing: "
            + f"{r['checks']['jax_codes_differing']}, scales differing: "
            + f"{r['checks']['jax_scales_differing']} of {r['checks']['blocks']:,} (at most "
            + f"{r['checks']['jax_scales_max_ulps']} ulp; dequantised values within "
            + f"{r['checks']['jax_max_steps']:.1e} quantisation steps), `jax.jit`-route payload "
            + ("identical" if r["checks"]["jax_payload_identical"] else "DIFFERENT")
            + ", public decode "
            + ("identical" if r["checks"]["decode_identical"] else "DIFFERENT")
            + f"; `jax.jit` compile {r['checks']['jax_compile_s']:.1f} s, CPU/wall "
            f"{r['checks']['jax_cpu_per_wall']:.1f}; public zstd −1 without the hash log "
            f"{r['plain_-1'] / r['payload'][-1] - 1:+.2%} bytes"
            for r in results
        )
        + ".",
    ]
    return lines


# --------------------------------------------------------------------------- table 3

WARM_UP = (
    "import time; t = time.perf_counter(); from shared import codec; "
    "i, c = time.perf_counter(), time.process_time(); codec.warm_up(); "
    "print(i - t, time.perf_counter() - i, time.process_time() - c)"
)


def sources_stamp() -> list[int]:
    """Modification times of the codec's sources: Numba's cache is keyed on them."""
    return [(REPO / "shared" / f).stat().st_mtime_ns for f in ("quant.py", "codec.py")]


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
    args = parser.parse_args()
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
