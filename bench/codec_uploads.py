"""Table 2 of ``bench/codec_parts.py``: the codec stack against public APIs, at the sizes
learners upload (its docstring says what is measured; the routes are in ``codec_routes.py``).
"""

from __future__ import annotations

import json
import time
from functools import partial

import numpy as np
import zstandard
from codec_routes import (  # bench/codec_routes.py
    BLOCK,
    UNIT_BYTES,
    NumpyQuantiser,
    dequantise,
    jax_encode,
    jax_quantiser,
    jax_repeats,
    model_layout,
    project_decompress,
    project_frames,
    project_quantise,
    public_compressor,
    public_decode,
    public_decompress,
    public_encode,
    public_frames,
    real_values,
    split,
    timed_cpu,
)
from evidence import note

from shared.codec import api as codec
from shared.codec import zstd
from shared.codec.config import CodecConfig
from shared.codec.segments import segment_plan

MODELS = ("small", "medium", "large")
# Calls per figure (best kept) in table 2, by model: fewer where one call takes seconds.
MODEL_REPEATS = {"small": 15, "medium": 9, "large": 6}
LINK_BITS_PER_S = 1e9


ROWS = {
    "enc1": "**encode, zstd 1: project** (`encode_flat`: Numba + `shared.codec.zstd`)",
    "enc1_np": "encode, zstd 1: public (NumPy quantiser + `ZstdCompressor`)",
    "enc1_jax": "encode, zstd 1: public (`jax.jit` quantiser + `ZstdCompressor`)",
    "enc-1": "**encode, zstd −1: project**",
    "enc-1_np": "encode, zstd −1: public (NumPy + `ZstdCompressor`, hash log 10)",
    "dec": "**decode: project** (`decode_tensors`)",
    "dec_np": "decode: public (`ZstdDecompressor` + NumPy)",
    "q_numba": "quantise only: Numba (`quantize.encode_segment`)",
    "q_np": "quantise only: NumPy",
    "q_jax": "quantise only: `jax.jit`, from the NumPy buffer",
    "q_jax_dev": "quantise only: `jax.jit`, input already a JAX array",
    "z1": "compress only, zstd 1: `shared.codec.zstd` (`compress_into` the payload buffer)",
    "z1_np": "compress only, zstd 1: `ZstdCompressor`, frames copied into one NumPy buffer",
    "z1_join": "compress only, zstd 1: `ZstdCompressor`, frames joined (`b''.join`)",
    "z-1": "compress only, zstd −1: `shared.codec.zstd` (hash log 10)",
    "z-1_np": "compress only, zstd −1: `ZstdCompressor`, hash log 10, one NumPy buffer",
    "z-1_join": "compress only, zstd −1: `ZstdCompressor`, hash log 10, `b''.join`",
    "z-1_plain": "compress only, zstd −1: `ZstdCompressor(level=-1)`, one NumPy buffer",
    "d": "decompress only: `shared.zstd.decompress` (with its checks)",
    "d_pub": "decompress only: `ZstdDecompressor.decompress`",
    "dq_numba": "dequantise only: Numba (`dequantize.decode_blocks`)",
    "dq_np": "dequantise only: NumPy (same checks)",
}
# (piece, project row, public row, payload level whose transfer time it is compared with)
GAINS = [
    ("Numba quantiser vs NumPy", "q_numba", "q_np", 1),
    ("Numba quantiser vs `jax.jit` from the NumPy buffer", "q_numba", "q_jax", 1),
    ("Numba quantiser vs `jax.jit` on a JAX array", "q_numba", "q_jax_dev", 1),
    ("Numba dequantiser vs NumPy", "dq_numba", "dq_np", 1),
    (
        "`shared.codec.zstd` compress, zstd 1, vs `ZstdCompressor` into one NumPy buffer",
        "z1",
        "z1_np",
        1,
    ),
    ("`shared.codec.zstd` compress, zstd 1, vs `ZstdCompressor` + `b''.join`", "z1", "z1_join", 1),
    (
        "`shared.codec.zstd` compress, zstd −1, vs `ZstdCompressor` into one buffer",
        "z-1",
        "z-1_np",
        -1,
    ),
    (
        "`shared.codec.zstd` compress, zstd −1, vs `ZstdCompressor` + `b''.join`",
        "z-1",
        "z-1_join",
        -1,
    ),
    ("`shared.codec.zstd` decompress vs `ZstdDecompressor.decompress`", "d", "d_pub", 1),
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
    plan = segment_plan("int8", BLOCK, layout)
    config = {lv: CodecConfig("int8", BLOCK, lv, threads=0) for lv in (1, -1)}
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
        "plain_minus_1": len(plain),
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
    note(json.dumps({k: v for k, v in result.items() if k not in ("times", "walls")}))
    for key, label in ROWS.items():
        link = link_s(result, -1 if "-1" in key else 1)
        note(
            f"  {name} {label}: CPU {times[key] * 1e3:.2f} ms = {times[key] / link:.1%}, "
            f"wall {walls[key] * 1e3:.2f} ms"
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
        "Gain of each compiled piece, and of `shared.codec.zstd` over plain public calls, = public "
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
        f"`quantize.address` (`ndarray.ctypes.data`): {address:.2f} µs a call (CPU time, best of "
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
            f"{r['plain_minus_1'] / r['payload'][-1] - 1:+.2%} bytes"
            for r in results
        )
        + ".",
    ]
    return lines
