"""The work of one int8 upload done two ways: by the project's codec, and with public APIs only.

Table 2 of ``bench/codec_parts.py`` (its docstring says what it measures): the data (one
upload of a model, filled with the captured real pseudo-gradients), each route's pieces (a
NumPy or ``jax.jit`` quantiser in the codec's segment layout, python-zstandard's public
compressor and decompressor, the same checksums and decode-side checks), the project's own
pieces called the same way, and the timing helpers the tables use.
"""

from __future__ import annotations

import gc
import time
import timeit
from collections.abc import Callable
from functools import partial

import numpy as np
import xxhash
import zstandard
from codec import timed  # bench/codec.py

from shared.codec import dequantize, quantize, zstd
from shared.codec.description import Description
from shared.codec.layout import Layout

BLOCK = 256
QMAX = np.float32(127)
F32_MAX = float(np.finfo(np.float32).max)
# The blocks the project's kernels send down their exact float64 path (shared/codec/quantize.py).
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


# --------------------------------------------------------------------------- table 2: data


def model_layout(name: str) -> Layout:
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
    return Layout({p.key: shapes[p.name][0 if p.layer is None else 1 :] for p in fragment})


def real_values(layout: Layout, rounds: list[dict[str, np.ndarray]]) -> tuple:
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
    """python-zstandard's public compressor writing frames as ``shared.codec.zstd`` does (content
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

    def __init__(self, values: np.ndarray, layout: Layout, plan) -> None:
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


def jax_quantiser(layout: Layout, plan) -> Callable:
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


def public_decode(payload, description: Description, dctx: zstandard.ZstdDecompressor) -> dict:
    """decode_tensors' work with public APIs: per frame check XXH3, decompress (a fresh
    ``bytes``), dequantise with NumPy; the tensors as views of one output buffer."""
    payload = memoryview(payload)
    segment = description.segment
    total = description.raw_size // UNIT_BYTES
    values = np.empty(total * BLOCK, np.float32)
    end = 0
    for index, (size, checksum) in enumerate(
        zip(description.frames, description.checksums, strict=True)
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
    for name, shape in zip(description.layout.names, description.layout.shapes, strict=True):
        size = int(np.prod(shape))
        out[name] = values[start : start + size].reshape(shape)
        start += -(-size // BLOCK) * BLOCK
    return out


# --------------------------------------------------------------------------- table 2: rows


def project_quantise(values: np.ndarray, plan) -> np.ndarray:
    """The codec's Numba kernel over every segment (as encode_flat calls it), into one buffer."""
    raw = np.empty(plan.raw_size, np.uint8)
    base, end = quantize.address(values), 0
    for pieces, raw_bytes in plan.jobs:
        offsets = plan.byte_offsets
        quantize.encode_segment(
            base, offsets, offsets, pieces, False, 8, BLOCK, raw[end : end + raw_bytes]
        )
        end += raw_bytes
    return raw


def project_frames(raw: np.ndarray, plan, compressor: zstd.Compressor) -> np.ndarray:
    """Each raw segment compressed by ``shared.codec.zstd`` straight into one payload buffer."""
    out = np.empty(plan.total_bound, np.uint8)
    src = dst = 0
    for _, raw_bytes in plan.jobs:
        dst += compressor.compress_into(raw[src : src + raw_bytes], out[dst:])
        src += raw_bytes
    return out[:dst]


def split(payload, description: Description) -> list[memoryview]:
    view, end, frames = memoryview(payload), 0, []
    for size in description.frames:
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
            bad = dequantize.decode_blocks(
                seg[4 * m :], seg[: 4 * m].view(np.float32), 8, BLOCK, values
            )
            if bad >= 0:
                raise ValueError("bad block")
        else:
            numpy_dequantise(seg, values)
        src, dst = src + raw_bytes, dst + m * BLOCK
    return out


def address_us() -> float:
    """µs per call of quantize.address (CPU time, in cache)."""
    call = partial(quantize.address, np.zeros(1000, np.float32))
    n = 20000
    return min(timeit.repeat(call, time.thread_time, number=n, repeat=5)) / n * 1e6
