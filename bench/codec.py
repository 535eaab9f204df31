"""Pseudo-gradient codec: throughput, compression and error of every scheme, beside a memcpy.

For pseudo-gradients of 1M, 10M and 100M float32 values (M = 2^20), of two kinds (Gaussian
noise, and real pseudo-gradients captured from a short training run of the ``small`` model),
encodes and decodes with every codec of :mod:`shared.codec` (fp32, bf16, int8, int4, int2) at
zstd level 1 (the default) and -1 (fast), single-threaded (``threads=0``). Reports encode and
decode throughput (fp32 input bytes per second, best of N) and their ratio to a plain
allocating memory copy (``np.copy``) of the same data measured in the same run, interleaved
with the codec calls; the compression ratio vs fp32 without and with zstd; and the relative L2
error. Raw figures (every row's best times, sizes and error, the copies) go to
``bench/results/codec.json``; the section is rendered from that file, with its claims (the
error bounds of docs/CODEC.md and the compression ratios the docs quote) under the table.

    .venv/bin/python bench/codec.py --write          # ≈ 4 min on 2 cores (+1 min first capture)
    .venv/bin/python bench/codec.py --render --write # the section from the stored results
    .venv/bin/python bench/codec.py --quick          # the smoke version: 1M, 2 repeats

The real pseudo-gradients are captured once (well under a minute) and cached in
``bench/.cache/`` (git-ignored); ``--recapture`` trains again.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evidence import (
    Claim,
    Provenance,
    at_least,
    at_most,
    publish,
    render_claims,
    results_path,
    save,
)
from pydantic import BaseModel

from shared.codec import api as codec
from shared.codec.config import CODECS, CodecConfig
from shared.codec.layout import Layout
from shared.settings.algorithm import InnerAlgorithmSettings
from shared.settings.workload import DEFAULT_UNITS, WorkloadSettings

SECTION = "## Pseudo-gradient codec"
PROGRAM = ".venv/bin/python bench/codec.py"
NAME = "codec"
# docs/CODEC.md: relative L2 errors on Gaussian data (tests/test_codec.py bound them there too)
MAX_ERROR = {"fp32": 0.0, "bf16": 0.003, "int8": 0.01, "int4": 0.15, "int2": 0.5}
# docs/CODEC.md and docs/NETWORK.md: ratio of a real pseudo-gradient's payload to fp32 (zstd 1)
MIN_RATIO = {"bf16": 2.0, "int8": 3.9, "int4": 7.7, "int2": 15.0}
MI = 1 << 20
SIZES = {"1M": MI, "10M": 10 * MI, "100M": 100 * MI}
REPEATS = {"1M": 15, "10M": 7, "100M": 3}
KINDS = ("gaussian", "real")
LEVELS = (1, -1)
CACHE = REPO / "bench" / ".cache" / "codec_real_pseudo_gradients.npz"

# The capture run: model, data and inner optimizer as a learner with default settings builds
# them (services/learner/service.py), one unit, no outer merges in between.
_WORKLOAD, _INNER = WorkloadSettings(), InnerAlgorithmSettings()
CAPTURE = {
    "model": _WORKLOAD.model,
    "rounds": 4,
    "h_steps": _INNER.h_steps,
    "batch_size": _WORKLOAD.batch_size,
    "inner_lr": _INNER.inner_lr,
    "warmup_steps": _INNER.warmup_steps,
    "max_steps": _WORKLOAD.max_steps,
    "weight_decay": _INNER.weight_decay,
    "seed": _WORKLOAD.seed,
    "unit": 0,
    "num_units": DEFAULT_UNITS,
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- real data


def capture_rounds(count: int = CAPTURE["rounds"]) -> list[dict[str, np.ndarray]]:
    """Train ``small`` for ``count`` rounds of H steps; return each round's Δ = anchor − θ."""
    import jax

    from services.learner.core import LearnerCore
    from services.learner.trainer import InnerTrainer
    from shared import data, model
    from shared.runtime import configure_jax

    c = CAPTURE
    configure_jax()
    cfg = model.get_config(c["model"])
    corpus = data.split_corpus(data.load_corpus(None), 0.02)
    shard = data.shard_for_unit(corpus.train, c["unit"], c["num_units"])
    sampler = data.BatchSampler(shard, cfg.seq_len, c["batch_size"], c["seed"], c["unit"])
    params = model.init_params(cfg, jax.random.PRNGKey(c["seed"]))
    core = LearnerCore(
        InnerTrainer(cfg, _INNER.optimizer(_WORKLOAD.max_steps)), params, _INNER.sync_schedule(1), 0
    )
    rounds: list[dict[str, np.ndarray]] = []
    step = 0
    while len(rounds) < count:
        loss = core.train_step(sampler.batch(step))
        step += 1
        for upload in core.due_uploads():
            rounds.append({k: np.asarray(v, np.float32) for k, v in upload.tensors.items()})
            log(f"  captured round {len(rounds)} after step {step} (loss {loss:.3f})")
    return rounds


def load_rounds(recapture: bool) -> list[dict[str, np.ndarray]]:
    """The captured rounds, from the cache unless it is missing, stale or ``recapture``."""
    meta = np.array(sorted(f"{k}={v}" for k, v in CAPTURE.items()))
    if CACHE.exists() and not recapture:
        with np.load(CACHE, allow_pickle=False) as npz:
            if np.array_equal(npz["meta"], meta):
                names = list(npz["names"])
                rounds = [
                    {n: npz[f"r{r}_{i}"] for i, n in enumerate(names)}
                    for r in range(int(npz["rounds"]))
                ]
                log(f"real pseudo-gradients: {len(rounds)} rounds from {CACHE}")
                return rounds
    log(f"capturing {CAPTURE['rounds']} rounds of {CAPTURE['h_steps']} steps...")
    t0 = time.perf_counter()
    rounds = capture_rounds()
    log(f"  capture took {time.perf_counter() - t0:.0f}s")
    names = sorted(rounds[0])
    arrays = {f"r{r}_{i}": rd[n] for r, rd in enumerate(rounds) for i, n in enumerate(names)}
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    np.savez(CACHE, meta=meta, names=np.array(names), rounds=len(rounds), **arrays)
    return rounds


# --------------------------------------------------------------------------- data sets


@dataclass
class DataSet:
    """``elements`` float32 values in one contiguous buffer, exposed as named tensor views."""

    size: str
    kind: str
    buffer: np.ndarray
    tensors: dict[str, np.ndarray]
    norm: float = field(init=False)
    layout: Layout = field(init=False)

    def __post_init__(self) -> None:
        self.norm = float(np.sqrt(sum(_sumsq(t) for t in self.tensors.values())))
        # The tensors are views of the buffer in sorted-name order, as a learner sends them.
        self.layout = Layout({name: t.shape for name, t in self.tensors.items()})
        assert self.layout.names == tuple(self.tensors)
        assert all(
            np.shares_memory(view, self.tensors[name])
            for name, view in self.layout.views(self.buffer).items()
        )


def _sumsq(a: np.ndarray) -> float:
    flat = a.reshape(-1)
    total = 0.0
    for lo in range(0, flat.size, MI):
        chunk = flat[lo : lo + MI].astype(np.float64)
        total += float(np.dot(chunk, chunk))
    return total


def layout(rounds: list[dict[str, np.ndarray]], elements: int):
    """Tensors (name, shape, round) of the captured rounds, in order, then tiled, to
    ``elements`` values; names are unique (``0000`` + parameter name), the last tensor is
    truncated (made 1-D) to hit the count exactly."""
    names = sorted(rounds[0])
    plan, total, copy = [], 0, 0
    while total < elements:
        r = copy % len(rounds)
        for n in names:
            shape = rounds[r][n].shape
            size = int(np.prod(shape))
            if total + size > elements:
                size = elements - total
                shape = (size,)
            plan.append((f"{copy:04d}{n}", shape, r, n, size))
            total += size
            if total == elements:
                break
        copy += 1
    return plan, copy


def make_dataset(size: str, kind: str, rounds, seed: int = 0) -> DataSet:
    elements = SIZES[size]
    plan, _ = layout(rounds, elements)
    buffer = np.empty(elements, np.float32)
    if kind == "gaussian":
        rng = np.random.default_rng(seed)
        for lo in range(0, elements, 16 * MI):
            rng.standard_normal(out=buffer[lo : lo + 16 * MI], dtype=np.float32)
        buffer *= np.float32(1e-3)
    tensors, offset = {}, 0
    for name, shape, r, source, n in plan:
        view = buffer[offset : offset + n]
        if kind == "real":
            view[:] = rounds[r][source].reshape(-1)[:n]
        tensors[name] = view.reshape(shape)
        offset += n
    return DataSet(size, kind, buffer, tensors)


def rel_l2_error(ds: DataSet, decoded: dict[str, np.ndarray]) -> float:
    err = 0.0
    for name, x in ds.tensors.items():
        y = decoded[name]
        assert y.shape == x.shape, (name, y.shape, x.shape)
        for lo in range(0, x.size, MI):
            d = y.reshape(-1)[lo : lo + MI].astype(np.float64) - x.reshape(-1)[lo : lo + MI]
            err += float(np.dot(d, d))
    return float(np.sqrt(err)) / ds.norm


# --------------------------------------------------------------------------- timing


def timed(function: Callable[[], object]) -> tuple[float, object]:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        result = function()
        return time.perf_counter() - t0, result
    finally:
        gc.enable()


class Row(BaseModel):
    """One codec at one zstd level on one data set: best times, sizes and error."""

    size: str
    kind: str
    codec: str
    level: int
    encode_s: float
    dict_encode_s: float
    decode_s: float
    raw_size: int
    payload_size: int
    error: float
    copy_s: float  # best np.copy time of this row's own repeats (the ×copy reference)


class CodecResults(BaseModel):
    """``bench/results/codec.json``."""

    provenance: Provenance
    sizes: list[str]
    repeats: dict[str, int]
    captured_s: float
    real_tensors: int
    real_params: int
    real_rounds: int
    rows: list[Row] = []
    copies: dict[str, float] = {}  # "size kind": best allocating copy, s
    copytos: dict[str, float] = {}  # size: best copy into a preallocated buffer, s


def measure(
    ds: DataSet,
    name: str,
    level: int,
    repeats: int,
    target: np.ndarray,
    copies: dict,
    copytos: dict,
) -> Row:
    """Best-of-``repeats`` encode and decode; an allocating copy (``copies``) and a copy into
    the preallocated ``target`` (``copytos``) are timed right before each encode."""
    config = CodecConfig(name, zstd_level=level, threads=0)
    best_enc = best_dict = best_dec = best_copy = float("inf")
    for repeat in range(repeats):
        payload = decoded = None  # free the last repeat's outputs first
        t, _ = timed(partial(np.copy, ds.buffer))
        best_copy = min(best_copy, t)
        copies[ds.size, ds.kind] = min(copies.get((ds.size, ds.kind), float("inf")), t)
        t, _ = timed(partial(np.copyto, target, ds.buffer))
        copytos[ds.size] = min(copytos.get(ds.size, float("inf")), t)
        t, (payload, description, _) = timed(
            partial(codec.encode_flat, ds.buffer, ds.layout, config)
        )
        best_enc = min(best_enc, t)
        t, (dict_payload, _, _) = timed(partial(codec.encode, ds.tensors, config))
        best_dict = min(best_dict, t)
        if repeat == 0:
            assert bytes(dict_payload) == bytes(payload), "encode and encode_flat differ"
        dict_payload = None
        t, decoded = timed(partial(codec.decode_tensors, payload, description, threads=0))
        best_dec = min(best_dec, t)
    error = rel_l2_error(ds, decoded)
    return Row(
        size=ds.size,
        kind=ds.kind,
        codec=name,
        level=level,
        encode_s=best_enc,
        dict_encode_s=best_dict,
        decode_s=best_dec,
        raw_size=description.raw_size,
        payload_size=len(payload),
        error=error,
        copy_s=best_copy,
    )


def warm_up() -> None:
    """Compile (or load from Numba's cache) every kernel: one encode + decode per codec."""
    x = {"w": np.random.default_rng(1).standard_normal((300, 7), np.float32)}
    for name in CODECS:
        payload, description, _ = codec.encode(x, CodecConfig(name))
        codec.decode_tensors(payload, description)


# --------------------------------------------------------------------------- report


def gbps(elements: int, seconds: float) -> float:
    return 4 * elements / seconds / 1e9


def render(results: CodecResults, checked: list[Claim], path: Path) -> str:
    c = CAPTURE
    rows, sizes, repeats = results.rows, results.sizes, results.repeats
    copies, copytos = results.copies, results.copytos
    n_params, captured_s = results.real_params, results.captured_s
    copy_text = "; ".join(
        f"{s}: {gbps(SIZES[s], copytos[s]):.1f} GB/s preallocated vs "
        + ", ".join(f"{gbps(SIZES[s], copies[f'{s} {k}']):.1f}" for k in KINDS)
        + " GB/s allocating (gaussian, real)"
        for s in sizes
    )
    load = "capture the real data (then cached)" if captured_s > 10 else "load the cached real data"
    reps = ", ".join(f"{repeats[s]} at {s}" for s in sizes)
    lines = [
        SECTION,
        "",
        results.provenance.line(path) + " Every codec of `shared/codec/` (block size 256) at "
        "zstd level 1 "
        f"(the default) and -1 (fast), on this machine ({os.cpu_count()} shared cores), "
        "single-threaded (`threads=0`). Sizes in float32 values, M = 2^20 = 1,048,576 "
        f"(1M = 4 MiB of fp32). Throughput = fp32 input bytes (4 × values) / best time of N "
        f"repeats ({reps}); GB/s = 10^9 bytes/s; decode includes allocating its output. "
        f"Before the timings: {captured_s:.0f} s to {load}.",
        "",
        "**encode** is `codec.encode_flat` of the data's one contiguous buffer with its "
        "`Layout`, the call a learner makes (its pseudo-gradient is one buffer); "
        "**dict encode** is `codec.encode` of the same tensors as a dict of arrays, which "
        "checks and locates every tensor on each call (same bytes, asserted).",
        "",
        "Data. **gaussian**: standard normal × 1e-3, in the same tensor layout as *real*. "
        f"**real**: pseudo-gradients Δ = anchor − θ captured with `LearnerCore` from "
        f"{c['rounds']} rounds of H={c['h_steps']} inner steps of a fresh `{c['model']}` model "
        f"({n_params:,} parameters in {results.real_tensors} tensors; AdamW peak lr "
        f"{c['inner_lr']:g}, "
        f"warm-up {c['warmup_steps']}, cosine over {c['max_steps']} steps, weight decay "
        f"{c['weight_decay']:g}, batch {c['batch_size']}, unit {c['unit']} of "
        f"{c['num_units']}, seed {c['seed']}: the learner's defaults). Each size takes the "
        "rounds' tensors in order (round 1, 2, …) and, past the captured rounds, tiles them "
        "again under distinct names until the value count is reached (the last tensor is "
        "truncated), so 100M holds each captured tensor about "
        f"{SIZES['100M'] // (results.real_rounds * n_params)} times.",
        "",
        "**copy**: `np.copy` of the same fp32 data (one contiguous array), which, like encode "
        "and decode, allocates its output. It is timed right before every encode, in the same "
        "run, and each row's ×copy columns divide by the best copy time of that row's own "
        "repeats (so a noisy moment affects both sides alike). Every timed call starts right "
        "after a full `gc.collect()` and runs with the collector off, so both sides start from "
        "the same cold caches. Best copy over the whole run, "
        f"and a copy into a preallocated buffer (`np.copyto`), for comparison: {copy_text}. "
        "Ratios are vs fp32: 4·values / packed size (without zstd) and 4·values / payload "
        "(with zstd). Error: ‖x̂ − x‖ / ‖x‖ over all tensors.",
        "",
        "| size | data | codec | zstd level | encode GB/s | ×copy | decode GB/s | ×copy "
        "| dict encode ×copy | ratio without zstd | ratio with zstd | rel. L2 error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n, copy_s = SIZES[r.size], r.copy_s
        lines.append(
            f"| {r.size} | {r.kind} | {r.codec} | {r.level} "
            f"| {gbps(n, r.encode_s):.2f} | {copy_s / r.encode_s:.2f}× "
            f"| {gbps(n, r.decode_s):.2f} | {copy_s / r.decode_s:.2f}× "
            f"| {copy_s / r.dict_encode_s:.2f}× "
            f"| {4 * n / r.raw_size:.2f} | {4 * n / r.payload_size:.2f} | {r.error:.2e} |"
        )
    lines += ["", "Do int8 and int4 reach 0.5× copy (single-threaded)?", ""]
    lines += [f"- {s}" for s in summarise(rows, sizes)]
    lines += ["", render_claims(checked)]
    return "\n".join(lines)


def claims(results: CodecResults) -> list[Claim]:
    """The error bounds of docs/CODEC.md (Gaussian data, zstd level 1, every size measured) and
    the compression ratios the docs quote (real pseudo-gradients, zstd level 1)."""
    out = []
    for name, bound in MAX_ERROR.items():
        errors = [r.error for r in results.rows if (r.codec, r.kind) == (name, "gaussian")]
        out.append(
            at_most(
                f"{name}: relative L2 error on Gaussian data ≤ {bound:g} (docs/CODEC.md)",
                max(errors) if errors else None,
                bound,
                ".2e",
            )
        )
    for name, bound in MIN_RATIO.items():
        ratios = [
            4 * SIZES[r.size] / r.payload_size
            for r in results.rows
            if (r.codec, r.kind, r.level) == (name, "real", 1)
        ]
        out.append(
            at_least(
                f"{name}: real pseudo-gradients ≥ {bound:g}× smaller than fp32 with zstd",
                min(ratios) if ratios else None,
                bound,
                ".2f",
            )
        )
    return out


def summarise(rows: list[Row], sizes: list[str]) -> list[str]:
    out = []
    for name in ("int8", "int4"):
        for size in sizes:
            for level in LEVELS:
                picked = [r for r in rows if (r.codec, r.size, r.level) == (name, size, level)]
                if not picked:
                    continue
                parts = []
                for what in ("encode", "decode"):
                    ratios = [r.copy_s / getattr(r, f"{what}_s") for r in picked]
                    shown = "/".join(f"{x:.2f}×" for x in ratios)
                    verdict = "yes" if min(ratios) >= 0.5 else "no"
                    parts.append(f"{what} {shown} → {verdict}")
                kinds = "/".join(r.kind for r in picked)
                out.append(f"{name} {size} zstd {level}: " + "; ".join(parts) + f" ({kinds})")
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help=f"comma-separated subset of {list(SIZES)}"
    )
    parser.add_argument(
        "--codecs", default=",".join(CODECS), help="comma-separated subset of codecs"
    )
    parser.add_argument(
        "--levels", default=",".join(map(str, LEVELS)), help="comma-separated zstd levels"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 1M only, 2 repeats")
    parser.add_argument("--recapture", action="store_true", help="retrain the real data")
    parser.add_argument("--render", action="store_true", help="run nothing: render the stored")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    path = results_path(NAME, args.quick)
    if args.render:
        if not path.exists():
            raise SystemExit(f"{path}: no stored results (run bench/codec.py first)")
        results = CodecResults.model_validate_json(path.read_text())
        report(results, args, path)
        return
    started = time.perf_counter()
    sizes = ["1M"] if args.quick else [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {list(SIZES)}")
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if unknown := [c for c in codecs if c not in CODECS]:
        parser.error(f"unknown codecs {unknown}; choose from {list(CODECS)}")
    try:
        levels = [int(v) for v in args.levels.split(",")]
    except ValueError:
        parser.error(f"--levels must be comma-separated ints, got {args.levels!r}")
    repeats = {s: 2 if args.quick else REPEATS[s] for s in sizes}
    full = sizes == list(SIZES) and codecs == list(CODECS) and levels == list(LEVELS)
    if args.write and (args.quick or not full):
        parser.error("--write records the full benchmark; drop --quick/--sizes/--codecs/--levels")

    configuration = {"sizes": sizes, "codecs": codecs, "levels": levels, "repeats": repeats}
    provenance = Provenance.start(PROGRAM, configuration, path)
    rounds = load_rounds(args.recapture)
    captured_s = time.perf_counter() - started
    started = time.perf_counter()
    warm_up()
    rows: list[Row] = []
    copies: dict = {}
    copytos: dict = {}
    for size in sizes:
        for kind in KINDS:
            ds = make_dataset(size, kind, rounds)
            target = np.empty_like(ds.buffer)
            log(f"{size} {kind}: {len(ds.tensors)} tensors, {ds.buffer.size:,} values")
            for level in levels:
                for name in codecs:
                    row = measure(ds, name, level, repeats[size], target, copies, copytos)
                    rows.append(row)
                    n = SIZES[size]
                    log(
                        f"  {name:4s} zstd {level:2d}: encode {gbps(n, row.encode_s):6.2f} "
                        f"decode {gbps(n, row.decode_s):6.2f} GB/s, copy "
                        f"{gbps(n, row.copy_s):5.1f} GB/s, ratio "
                        f"{4 * n / row.payload_size:5.2f}, error {row.error:.2e}"
                    )
            del ds, target
        for name, error in (
            (r.codec, r.error) for r in rows if r.size == size and r.codec in ("fp32", "bf16")
        ):
            limit = 0.0 if name == "fp32" else 2.0**-9
            assert error <= limit, f"{name} error {error} above {limit}"

    provenance.seconds = round(time.perf_counter() - started + captured_s, 1)
    results = CodecResults(
        provenance=provenance,
        sizes=sizes,
        repeats=repeats,
        captured_s=round(captured_s, 1),
        real_tensors=len(rounds[0]),
        real_params=sum(a.size for a in rounds[0].values()),
        real_rounds=len(rounds),
        rows=rows,
        copies={f"{size} {kind}": t for (size, kind), t in copies.items()},
        copytos=copytos,
    )
    save(path, results)
    report(results, args, path)


def report(results: CodecResults, args: argparse.Namespace, path: Path) -> None:
    """Render the stored results, write the section when asked, exit on the claims."""
    checked = claims(results)
    publish(SECTION, render(results, checked, path), checked, args.write, args.quick)


if __name__ == "__main__":
    main()
