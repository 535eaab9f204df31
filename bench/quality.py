"""Quality benchmark: does asynchronous merging match synchronous DiLoCo?

Protocol (as in the DiLoCo papers): every method starts from the same briefly pretrained
checkpoint (single-unit steps on unit 0's shard), then trains the same model on the same corpus
with K units and the same total token budget. Methods run on a simulated clock in one process
(``sim/training.py``, driving the very ``LearnerCore``/``OuterCore`` the services run),
with unit speeds homogeneous or heterogeneous (slowdowns 1, 1, 2, 4). Headline rows are repeated
over several data-order seeds and reported as mean ± standard deviation.

The default configuration is also run once on the real system (``diloco up``: nats-server,
outer, gateway and learner processes) from scratch, beside a simulated twin of that same run.

With ``--codecs`` it instead runs the default configuration (heterogeneous speeds) once per
upload codec — fp32, int8, int4, int2 without and with error feedback — over the same seeds,
and reports each against fp32 (its own BENCHMARKS.md section).

    .venv/bin/python bench/quality.py --write          # ≈ 15-20 min on 2 cores
    .venv/bin/python bench/quality.py --codecs --write # ≈ 15 min on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from report import shown_command, write_section

from shared import data, evaluation, model
from shared.codec.config import BITS
from shared.runtime import configure_jax
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.cli import to_flags
from shared.settings.codec import CodecSettings
from shared.settings.workload import WorkloadSettings
from sim import training as sim

SECTION = "## Quality: asynchronous merging vs synchronous DiLoCo"
CODEC_SECTION = "## Quality: upload codecs"
DOWNLINK_SECTION = "## Quality: downlink (how global params reach units)"
CODECS: list[tuple[str, dict[str, Any]]] = [
    ("fp32", {"codec": "fp32"}),
    ("int8 (default)", {}),
    ("int4", {"codec": "int4"}),
    ("int2 without error feedback", {"codec": "int2", "error_feedback": False}),
    ("int2 with error feedback", {"codec": "int2", "error_feedback": True}),
]
# Ternary int2 without error feedback delivers only part of each update along its direction
# (its least-squares scale shrinks it): <Q(x), x> / |x|^2 measured 0.87-0.92 on the small
# model's real pseudo-gradients (bench/codec.py's captured rounds) and 0.81 on Gaussian data.
# That acts like a smaller outer learning rate, so this control row runs fp32 with the outer
# LR scaled by the same factor.
INT2_SHRINK = 0.87
LR_CONTROL = f"fp32 with outer lr x {INT2_SHRINK} (control for int2's shrinkage)"
HETEROGENEOUS = [1.0, 1.0, 2.0, 4.0]
HOMOGENEOUS = [1.0, 1.0, 1.0, 1.0]


@dataclass
class Method:
    """One row of the benchmark: a baseline, or the asynchronous algorithm with its settings
    (the shipped ones unless a row changes them)."""

    name: str
    kind: str  # "dp", "sync" or "async"
    speeds: list[float] | None = None
    algorithm: AlgorithmSettings = field(default_factory=AlgorithmSettings)
    codec: CodecSettings = field(default_factory=CodecSettings)
    headline: bool = False


def async_method(
    name: str,
    setup: sim.SimSetup,
    speeds: list[float],
    headline: bool = False,
    codec: dict[str, Any] | None = None,
    **changes: Any,
) -> Method:
    """The setup's algorithm and codecs (the shipped defaults) with ``changes`` to the
    algorithm's settings and ``codec`` to the codecs'."""
    algorithm = sim.changed(setup.algorithm, **changes)
    return Method(
        name, "async", speeds, algorithm, sim.changed(setup.codec, **(codec or {})), headline
    )


def methods(setup: sim.SimSetup) -> list[Method]:
    """Every row: baselines, naive async, the alternatives, and the default."""
    naive = {
        "outer_optimizer": "nesterov",
        "merge_policy": "each",
        "staleness_rule": "constant",
        "dynamic_h": False,
    }
    naive_name = "naive async (each arrival, Nesterov)"
    rows = [
        Method("data-parallel", "dp"),
        Method("synchronous DiLoCo", "sync", headline=True),
        async_method(naive_name, setup, HOMOGENEOUS, **naive),
        async_method(naive_name, setup, HETEROGENEOUS, headline=True, **naive),
    ]
    quorum = {"outer_optimizer": "nesterov", "merge_policy": "quorum", "min_quorum": 1}
    default = "default: Delayed Nesterov + 1/sqrt(1+s) + DyLU"
    rows += [
        async_method(default, setup, HOMOGENEOUS),
        async_method(default, setup, HETEROGENEOUS, headline=True),
        async_method("default without DyLU", setup, HETEROGENEOUS, dynamic_h=False),
        async_method(
            "quorum 1 + grace window + tokens2/steps + Nesterov + DyLU",
            setup,
            HETEROGENEOUS,
            **quorum,
        ),
        async_method("same with RDA", setup, HETEROGENEOUS, **quorum, combine="rda"),
        async_method(
            "default with P=2 fragments, tau=1, alpha=0.5",
            setup,
            HETEROGENEOUS,
            fragments=2,
            overlap_tau=1,
            mix_alpha=0.5,
        ),
    ]
    return rows


def run_method(method: Method, work: sim.Workload, start) -> sim.SimResult:
    if method.kind == "dp":
        return sim.data_parallel(work, start)
    if method.kind == "sync":
        return sim.sync_diloco(work, start)
    return sim.async_run(work, start, method.speeds, method.name, method.algorithm, method.codec)


def codec_methods(setup: sim.SimSetup, momentum: float | None = None) -> list[Method]:
    """The default configuration (heterogeneous speeds) once per upload codec.

    ``momentum`` overrides the outer momentum of every row (None: the default).
    """
    changes = {} if momentum is None else {"outer_momentum": momentum}
    rows = [
        async_method(name, setup, HETEROGENEOUS, headline=True, codec=codec, **changes)
        for name, codec in CODECS
    ]
    lr = setup.algorithm.outer_lr * INT2_SHRINK
    rows.append(
        async_method(
            LR_CONTROL,
            setup,
            HETEROGENEOUS,
            headline=True,
            codec={"codec": "fp32"},
            **{**changes, "outer_lr": lr},
        )
    )
    return rows


#: Rows of the downlink comparison: how globals reach a unit, and in which codec.
DOWNLINKS = [
    ("newest (every version), fp32", "fp32", "newest"),
    ("newest (every version), bf16", "bf16", "newest"),
    ("newest (every version), int8", "int8", "newest"),
    ("after each upload, fp32", "fp32", "after_upload"),
    ("after each upload, int8", "int8", "after_upload"),
]
DOWNLINK_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / 256}


def downlink_methods(setup: sim.SimSetup) -> list[Method]:
    """The default configuration (heterogeneous speeds, int8 uploads) once per downlink."""
    return [
        async_method(
            name,
            setup,
            HETEROGENEOUS,
            headline=True,
            codec={"params_codec": params_codec},
            params_fetch=params_fetch,
        )
        for name, params_codec, params_fetch in DOWNLINKS
    ]


def real_system_run(setup: sim.SimSetup, cache: Path) -> tuple[float, str]:
    """`diloco up` with the setup's settings (the flags of what it changes from the defaults)
    and heterogeneous speeds; returns its final eval and the command."""
    changed = [
        *to_flags(setup.workload, sorted(setup.workload.model_fields_set)),
        *to_flags(setup.algorithm, sorted(setup.algorithm.model_fields_set)),
    ]
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        *changed,
        "--learners",
        str(setup.num_units),
        "--slowdowns",
        ",".join(str(s) for s in HETEROGENEOUS),
        "--gateway-port",
        "0",
    ]
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "DILOCO_JAX_CACHE": str(cache)}
        out = subprocess.run(
            [*command, "--data-dir", data_dir],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    match = re.search(r"-> ([\d.]+) nats/byte", out.stdout)
    if out.returncode != 0 or not match:
        raise SystemExit(f"real-system run failed:\n{out.stdout}\n{out.stderr}")
    shown = " ".join(command[2:])
    return float(match.group(1)), f"diloco {shown}"


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f} (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=80, help="inner steps per unit (budget)")
    parser.add_argument(
        "--h-steps", type=int, default=None, help="H of every method (default: the shipped H)"
    )
    parser.add_argument("--pretrain", type=int, default=40, help="shared pretraining steps")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the headline rows")
    parser.add_argument("--no-real", action="store_true", help="skip the real-system run")
    parser.add_argument("--codecs", action="store_true", help="compare upload codecs instead")
    parser.add_argument(
        "--downlink", action="store_true", help="compare how globals reach units instead"
    )
    parser.add_argument(
        "--outer-momentum", type=float, default=None, help="--codecs: override outer momentum"
    )
    parser.add_argument(
        "--only", default="", help="run only rows whose name contains this (a|b: either)"
    )
    parser.add_argument(
        "--section", default=CODEC_SECTION, help="BENCHMARKS.md heading of the --codecs table"
    )
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md + plot")
    args = parser.parse_args()
    configure_jax()
    started = time.time()
    workload = WorkloadSettings(model=args.model, max_steps=args.steps)
    algorithm = AlgorithmSettings(**({} if args.h_steps is None else {"h_steps": args.h_steps}))
    setup = sim.SimSetup(workload=workload, algorithm=algorithm)
    cfg = model.get_config(args.model)
    corpus = data.split_corpus(data.load_corpus(None), 0.02)
    evaluate = evaluation.make_evaluator(cfg, data.eval_batches(corpus.heldout, cfg.seq_len, 16, 8))
    init = model.init_params(cfg, jax.random.PRNGKey(workload.seed))
    base = sim.Workload(setup, corpus, evaluate)
    start = sim.pretrain(base, init, args.pretrain)
    print(f"pretrained {args.pretrain} steps: eval {base.eval_loss(start):.4f}", flush=True)

    if args.codecs:
        make_rows = functools.partial(codec_methods, momentum=args.outer_momentum)
    elif args.downlink:
        make_rows = downlink_methods
    else:
        make_rows = methods
    wanted = args.only.split("|")
    rows = [m for m in make_rows(setup) if any(w in m.name for w in wanted)]
    results: dict[int, list[sim.SimResult]] = {}
    for index, method in enumerate(rows):
        seeds = range(args.seeds if method.headline else 1)
        for seed in seeds:
            work = base.with_seed(workload.seed + seed)
            t0 = time.time()
            result = run_method(method, work, start)
            results.setdefault(index, []).append(result)
            speeds = "-" if method.speeds is None else ",".join(f"{s:g}" for s in method.speeds)
            print(
                f"{method.name:48s} speeds {speeds:8s} seed {seed}: {result.final_eval:.4f} "
                f"({result.outer_steps} outer steps, {time.time() - t0:.0f}s)",
                flush=True,
            )

    if args.codecs:
        table = render_codecs(args, setup, rows, results, time.time() - started)
        print("\n" + table)
        if args.write:
            write_section(args.section, table)
        return
    if args.downlink:
        table = render_downlink(args, setup, rows, results, time.time() - started)
        print("\n" + table)
        if args.write:
            write_section(DOWNLINK_SECTION, table)
        return
    twin = real = None
    if not args.no_real:
        twin = sim.async_run(base, init, HETEROGENEOUS, "default (twin)")
        print(f"simulated twin of the real run (from scratch): {twin.final_eval:.4f}", flush=True)
        real, real_command = real_system_run(setup, Path(tempfile.mkdtemp()))
        print(f"real system: {real:.4f}  ({real_command})", flush=True)

    table = render(args, setup, rows, results, twin, real, time.time() - started)
    print("\n" + table)
    if args.write:
        plot(rows, results, REPO / "bench" / "quality.png")
        write_section(SECTION, table)


def render(args, setup, rows, results, twin, real, elapsed_s) -> str:
    def mean(index):
        return statistics.mean(r.final_eval for r in results[index])

    names = [m.name for m in rows]
    sync = mean(names.index("synchronous DiLoCo")) if "synchronous DiLoCo" in names else None
    dp = mean(names.index("data-parallel")) if "data-parallel" in names else None
    command = shown_command("python bench/quality.py")
    lines = [
        SECTION,
        "",
        f"`{command.strip()}` — model `{setup.workload.model}`, K={setup.num_units} units, "
        f"{setup.steps_per_unit} inner steps per unit of batch {setup.workload.batch_size} "
        f"({setup.token_budget:,} tokens in all), H={setup.algorithm.h_steps}, from a checkpoint "
        f"pretrained for {args.pretrain} single-unit steps; simulated clock "
        f"(step {setup.step_time_s} s × slowdown, latency {setup.latency_s} s). "
        "Heterogeneous speeds = slowdowns "
        f"{','.join(f'{s:g}' for s in HETEROGENEOUS)}. Eval: held-out nats/byte. "
        f"Whole run: {elapsed_s / 60:.1f} min on {os.cpu_count()} cores.",
        "",
        "| method | speeds | final eval (nats/byte) | vs sync DiLoCo | vs data-parallel "
        "| outer steps | updates per merge |",
        "|---|---|---|---|---|---|---|",
    ]
    for index, method in enumerate(rows):
        if index not in results:
            continue
        value = mean(index)
        speeds = (
            "homogeneous"
            if method.speeds == HOMOGENEOUS
            else "heterogeneous"
            if method.speeds
            else "n/a"
        )
        vs_sync = f"{100 * (value / sync - 1):+.2f}%" if sync else "-"
        vs_dp = f"{100 * (value / dp - 1):+.2f}%" if dp else "-"
        first = results[index][0]
        merged = f"{first.merged_per_step:.2f}" if method.kind == "async" else "-"
        lines.append(
            f"| {method.name} | {speeds} | {fmt([r.final_eval for r in results[index]])} "
            f"| {vs_sync} | {vs_dp} | {first.outer_steps} | {merged} |"
        )
    if twin is not None and real is not None:
        lines += [
            "",
            "Real system (processes + NATS, `diloco up` with the default algorithm, slowdowns "
            f"1,1,2,4, from scratch, same budget): **{real:.4f}** nats/byte; its simulated twin "
            f"(same start, budget and algorithm): **{twin.final_eval:.4f}** "
            f"({100 * (real / twin.final_eval - 1):+.2f}%).",
        ]
    lines += ["", "![eval loss vs tokens](bench/quality.png)", ""]
    return "\n".join(lines)


def render_codecs(args, setup, rows, results, elapsed_s) -> str:
    """Codec rows against fp32, paired by seed (same data order and arrival sequence)."""
    names = [m.name for m in rows]
    fp32 = results.get(names.index("fp32")) if "fp32" in names else None
    command = shown_command("python bench/quality.py")
    lines = [
        args.section,
        "",
        f"`{command.strip()}` — the default configuration (Delayed Nesterov, (1+s)^-0.5, "
        f"DyLU; slowdowns {','.join(f'{s:g}' for s in HETEROGENEOUS)}"
        + ("" if args.outer_momentum is None else f"; outer momentum {args.outer_momentum:g}")
        + ") with model "
        f"`{setup.workload.model}`, K={setup.num_units}, {setup.steps_per_unit} inner steps "
        f"per unit, H={setup.algorithm.h_steps}, {args.pretrain} pretraining steps, block size "
        "256; only the "
        "upload codec changes. Every codec runs the same seeds, so each seed's data order and "
        "arrival sequence are the same across rows; the last column is the mean over seeds of "
        "the per-seed difference to fp32. Eval: held-out nats/byte. "
        f"Whole run: {elapsed_s / 60:.1f} min on {os.cpu_count()} cores.",
        "",
        "| upload codec | bits/value (with scales) | final eval (nats/byte) | vs fp32 (paired) |",
        "|---|---|---|---|",
    ]
    for index, method in enumerate(rows):
        if index not in results:
            continue
        finals = [r.final_eval for r in results[index]]
        if fp32 is not None:
            diffs = [
                100 * (r.final_eval / f.final_eval - 1)
                for r, f in zip(results[index], fp32, strict=True)
            ]
            spread = f" ± {statistics.stdev(diffs):.2f}" if len(diffs) > 1 else ""
            vs = f"{statistics.mean(diffs):+.2f}%{spread}"
        else:
            vs = "-"
        config = method.codec
        bits = BITS[config.codec]
        if config.codec.startswith("int"):
            bits_shown = f"{bits + 32 / config.block_size:.3g}"
        else:
            bits_shown = str(bits)
        lines.append(f"| {method.name} | {bits_shown} | {fmt(finals)} | {vs} |")
    lines.append("")
    return "\n".join(lines)


def render_downlink(args, setup, rows, results, elapsed_s) -> str:
    """Downlink rows against the first (every version in fp32), paired by seed."""
    command = shown_command("python bench/quality.py")
    lines = [
        DOWNLINK_SECTION,
        "",
        f"`{command.strip()}` — the default configuration (Delayed Nesterov, (1+s)^-0.5, "
        f"DyLU, int8 uploads; slowdowns {','.join(f'{s:g}' for s in HETEROGENEOUS)}) with "
        f"model `{setup.workload.model}`, K={setup.num_units}, {setup.steps_per_unit} inner "
        f"steps per unit, H={setup.algorithm.h_steps}, {args.pretrain} pretraining steps; only "
        "how the global "
        "params reach the units changes: `--params-fetch newest` (every version the outer "
        "publishes: no link is slow here) or `after_upload` (the first version after each of "
        "the unit's uploads), in `--params-codec` fp32, bf16 or blockwise int8 (block 256, "
        "each version encoded afresh). Copies per sync period: 1 after each upload, about "
        f"K={setup.num_units} for every version. Same seeds in every row; the "
        "last column is the mean over seeds of the per-seed difference to the first row. "
        f"Eval: held-out nats/byte. Whole run: {elapsed_s / 60:.1f} min on {os.cpu_count()} "
        "cores.",
        "",
        "| global params reach a unit | bytes/param per copy | final eval (nats/byte) "
        "| vs first row (paired) |",
        "|---|---|---|---|",
    ]
    first = results.get(0)
    for index, method in enumerate(rows):
        if index not in results:
            continue
        finals = [r.final_eval for r in results[index]]
        vs = "-"
        if first is not None and index > 0:
            diffs = [
                100 * (r.final_eval / f.final_eval - 1)
                for r, f in zip(results[index], first, strict=True)
            ]
            spread = f" ± {statistics.stdev(diffs):.2f}" if len(diffs) > 1 else ""
            vs = f"{statistics.mean(diffs):+.2f}%{spread}"
        size = DOWNLINK_BYTES[method.codec.params_codec]
        lines.append(f"| {method.name} | {size:.3g} | {fmt(finals)} | {vs} |")
    lines.append("")
    return "\n".join(lines)


def plot(rows, results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for index, method in enumerate(rows):
        if index not in results or not (method.headline or method.kind != "async"):
            continue
        curve = results[index][0].curve
        label = method.name + (" (heterogeneous)" if method.speeds == HETEROGENEOUS else "")
        ax.plot([t for t, _ in curve], [v for _, v in curve], marker="o", ms=3, label=label)
    ax.set_xlabel("tokens processed (all units)")
    ax.set_ylabel("held-out eval loss (nats/byte)")
    ax.set_title("Eval loss vs tokens (seed 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
