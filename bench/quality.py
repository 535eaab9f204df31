"""Quality benchmarks: final held-out eval at equal tokens.

**The real system** (the default; ``## Quality: asynchronous merging vs synchronous DiLoCo``):
the decoupled default, synchronous DiLoCo (``--mode sync``) and the data-parallel-like
parameter server, each run by ``bench/goodput.py`` as a whole ``diloco up`` cluster (processes
+ NATS, the shipped downlink) without failures, with 3 seeds; this script reads those runs
from ``bench/results/goodput.json``, runs the simulator's twin of each (``sim/training.py``,
driving the very ``LearnerCore``/``OuterCore`` the services run: same model, units, budget, H,
seed and start, on a simulated clock with equal unit speeds), stores the twins in
``bench/results/quality.json`` and renders both with the gap between them.

**Simulator studies** (``--alternatives``, ``--codecs``, ``--downlink``): protocol as in the
DiLoCo papers: every method starts from the same briefly pretrained checkpoint, then trains
with K units and the same total token budget on the simulated clock, with unit speeds
homogeneous or heterogeneous (slowdowns 1, 1, 2, 4); headline rows are repeated over several
data-order seeds and reported as mean ± standard deviation. ``--alternatives``: the other
merge rules (naive async, quorum, RDA, fragments); ``--codecs``: the default configuration
once per upload codec against fp32; ``--downlink``: how global params reach units.

    .venv/bin/python bench/quality.py --write            # the real-system table (sim twins)
    .venv/bin/python bench/quality.py --render --write   # from the stored results
    .venv/bin/python bench/quality.py --codecs --write   # ≈ 15 min on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evidence import (
    Claim,
    Provenance,
    at_least,
    note,
    publish,
    ratio_at_most,
    render_claims,
    results_path,
    save,
)
from goodput_results import GoodputRun
from goodput_results import load as load_goodput
from pydantic import BaseModel
from report import shown_command, write_section

from shared import data, evaluation, model
from shared.codec.config import BITS
from shared.runtime import configure_jax
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.codec import CodecSettings
from shared.settings.workload import WorkloadSettings
from sim import training as sim

SECTION = "## Quality: asynchronous merging vs synchronous DiLoCo"
ALTERNATIVES_SECTION = "## Quality in the simulator: alternatives to the default"
NAME = "quality"
PROGRAM = ".venv/bin/python bench/quality.py"
GOODPUT = REPO / "bench" / "results" / "goodput.json"
REAL_METHODS = ("decoupled", "sync", "dp-like")
REAL_SEEDS = 3  # seeds per method the real-system table needs
MAX_VS_SYNC = 1.02  # decoupled's mean final eval over synchronous DiLoCo's
MAX_TWIN_GAP = 1.03  # the simulator's twin against the real system, either way, per method
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


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f} (n={len(values)})"


class TwinRun(BaseModel):
    """The simulator's twin of one real run: same method, seed, model, units, budget and H."""

    method: str
    seed: int
    final_eval: float
    curve: list[tuple[int, float]]
    outer_steps: int
    seconds: float


class QualityResults(BaseModel):
    """``bench/results/quality.json``: the simulator's twins of the real runs."""

    provenance: Provenance
    twins: list[TwinRun] = []


def real_runs(goodput: Path) -> dict[str, list[GoodputRun]]:
    """Per method, the real runs without failures and without a link cap, by seed."""
    runs = load_goodput(goodput).runs.values()
    out: dict[str, list[GoodputRun]] = {m: [] for m in REAL_METHODS}
    for run in sorted(runs, key=lambda r: r.seed):
        if run.mtbf_s is None and run.link is None and run.method in out:
            out[run.method].append(run)
    return out


def twin_algorithm(method: str, h_steps: int) -> AlgorithmSettings:
    """The algorithm settings of a method as ``bench/goodput.py`` runs it."""
    if method == "dp-like":
        return AlgorithmSettings(h_steps=1, outer_lr=1.0, outer_momentum=0.0)
    return AlgorithmSettings(h_steps=h_steps)


def run_twin(method: str, seed: int, config: dict[str, Any], corpus, evaluate) -> TwinRun:
    """The simulated twin of a real run: from the same initial params (the seed's), the same
    data order, equal unit speeds."""
    workload = WorkloadSettings(model=config["model"], max_steps=config["steps"], seed=seed)
    setup = sim.SimSetup(
        workload=workload,
        algorithm=twin_algorithm(method, config["h_steps"]),
        num_units=config["learners"],
    )
    cfg = model.get_config(config["model"])
    init = model.init_params(cfg, jax.random.PRNGKey(seed))
    work = sim.Workload(setup, corpus, evaluate)
    t0 = time.time()
    if method == "decoupled":
        result = sim.async_run(work, init, [1.0] * setup.num_units, "decoupled (twin)")
    else:
        result = sim.sync_diloco(work, init)
    return TwinRun(
        method=method,
        seed=seed,
        final_eval=round(result.final_eval, 5),
        curve=[(t, round(v, 5)) for t, v in result.curve],
        outer_steps=result.outer_steps,
        seconds=round(time.time() - t0, 1),
    )


def real_claims(real: dict[str, list[GoodputRun]], twins: list[TwinRun]) -> list[Claim]:
    """Seeds measured, decoupled against synchronous DiLoCo, and the simulator's gap."""

    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None

    finals = {m: [r.final_eval for r in runs if r.final_eval] for m, runs in real.items()}
    out = [
        at_least(
            f"{method}: seeds measured on the real system", len(finals[method]), REAL_SEEDS, "d"
        )
        for method in REAL_METHODS
    ]
    out.append(
        ratio_at_most(
            f"decoupled's mean final eval ≤ {MAX_VS_SYNC:g}× synchronous DiLoCo's (real system)",
            mean(finals["decoupled"]),
            mean(finals["sync"]),
            MAX_VS_SYNC,
        )
    )
    for method in REAL_METHODS:
        twin = mean([t.final_eval for t in twins if t.method == method])
        real_mean = mean(finals[method])
        gap = None
        if twin is not None and real_mean is not None:
            gap = max(twin / real_mean, real_mean / twin)
        out.append(
            Claim(
                f"{method}: the simulator's twin within {100 * (MAX_TWIN_GAP - 1):g}% of the "
                "real system (mean final eval)",
                "not measured" if gap is None else f"{twin:.4f} vs {real_mean:.4f}",
                None if gap is None else gap <= MAX_TWIN_GAP,
            )
        )
    return out


def render_real(
    real: dict[str, list[GoodputRun]], results: QualityResults, checked: list[Claim], path: Path
) -> str:
    config = results.provenance.configuration
    twins = {(t.method, t.seed): t for t in results.twins}
    sync = [r.final_eval for r in real["sync"] if r.final_eval]
    sync_mean = statistics.fmean(sync) if sync else None
    commits = sorted({r.commit for runs in real.values() for r in runs})
    lines = [
        SECTION,
        "",
        results.provenance.line(path)
        + f" Real runs: `{config['goodput']}` (made by `.venv/bin/python bench/goodput.py`, "
        f"commit{'s' if len(commits) > 1 else ''} {', '.join(f'`{c}`' for c in commits)}).",
        "",
        f"Model `{config['model']}`, {config['learners']} units, {config['steps']} inner steps "
        f"per unit (the same tokens for every method), H={config['h_steps']}, from scratch "
        "(the seed's initial params), without failures or link caps. **Real**: whole `diloco "
        "up` clusters with the shipped codecs and downlink (int8 uploads, int4 deltas down; the "
        "parameter server fp32 both ways). **Simulator**: the twin of each run (same seed, "
        "model, units, budget and H; equal unit speeds on a simulated clock; the sync and "
        "parameter-server twins average exact fp32 deltas and hand back exact params). Methods: "
        "decoupled (the shipped defaults); sync (`--mode sync`: every H steps every unit waits "
        "for the Nesterov step on the units' mean); dp-like (a parameter server: `--mode sync "
        "--h-steps 1 --codec fp32 --params-codec fp32 --outer-optimizer sgd --outer-lr 1.0 "
        "--outer-momentum 0 --params-downlink copy --norm-guard off`). Final held-out eval in "
        "nats/byte; ± is the standard deviation over seeds.",
        "",
        "| method | real: final eval | real: vs sync | simulator: final eval | simulator − real "
        "| seeds | real per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in REAL_METHODS:
        runs = [r for r in real[method] if r.final_eval]
        finals = [r.final_eval for r in runs]
        sims = [twins[(method, r.seed)].final_eval for r in runs if (method, r.seed) in twins]
        real_mean = statistics.fmean(finals) if finals else None
        sim_mean = statistics.fmean(sims) if sims else None
        vs_sync = f"{100 * (real_mean / sync_mean - 1):+.2f}%" if real_mean and sync_mean else "-"
        gap = f"{100 * (sim_mean / real_mean - 1):+.2f}%" if sim_mean and real_mean else "-"
        per_seed = ", ".join(f"{r.final_eval:.4f} (seed {r.seed})" for r in runs)
        lines.append(
            f"| {method} | {fmt(finals) if finals else '-'} | {vs_sync} "
            f"| {fmt(sims) if sims else '-'} | {gap} | {len(finals)} | {per_seed} |"
        )
    lines += ["", render_claims(checked)]
    return "\n".join(lines)


def real_main(args: argparse.Namespace) -> None:
    """The real-system table: read the real runs, run (or load) their twins, render, check."""
    path = results_path(NAME, args.quick)
    goodput = args.goodput or results_path("goodput", args.quick)
    real = real_runs(goodput)
    if args.render:
        if not path.exists():
            raise SystemExit(f"{path}: no stored results (run bench/quality.py first)")
        results = QualityResults.model_validate_json(path.read_text())
    else:
        stored = load_goodput(goodput).provenance
        configuration = {
            k: stored[-1].configuration[k] for k in ("model", "learners", "steps", "h_steps")
        }
        shown = goodput.resolve()
        configuration["goodput"] = str(
            shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
        )
        configuration["sim_seeds"] = args.sim_seeds
        results = QualityResults(provenance=Provenance.start(PROGRAM, configuration, path))
        started = time.monotonic()
        configure_jax()
        cfg = model.get_config(configuration["model"])
        corpus = data.split_corpus(data.load_corpus(None), 0.02)
        evaluate = evaluation.make_evaluator(
            cfg, data.eval_batches(corpus.heldout, cfg.seq_len, 16, 8)
        )
        last = stored[-1].configuration
        seeds = list(dict.fromkeys([last["seed"], *last["seeds"]]))[: args.sim_seeds]
        for method in REAL_METHODS:
            for seed in seeds:
                twin = run_twin(method, seed, configuration, corpus, evaluate)
                results.twins.append(twin)
                note(f"twin {method} seed {seed}: {twin.final_eval:.4f} ({twin.seconds:.0f}s)")
                results.provenance.seconds = round(time.monotonic() - started, 1)
                save(path, results)
    checked = real_claims(real, results.twins)
    text = render_real(real, results, checked, path)
    publish(SECTION, text, checked, args.write, args.quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=80, help="inner steps per unit (budget)")
    parser.add_argument(
        "--h-steps", type=int, default=None, help="H of every method (default: the shipped H)"
    )
    parser.add_argument("--pretrain", type=int, default=40, help="shared pretraining steps")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the headline rows")
    parser.add_argument(
        "--alternatives", action="store_true", help="simulator: the other merge rules instead"
    )
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
    parser.add_argument(
        "--goodput", type=Path, default=None, help="the real runs (bench/results/goodput.json)"
    )
    parser.add_argument("--sim-seeds", type=int, default=REAL_SEEDS, help="twins per method")
    parser.add_argument("--render", action="store_true", help="run nothing: render the stored")
    parser.add_argument("--quick", action="store_true", help="smoke run (results elsewhere)")
    args = parser.parse_args()
    if not (args.alternatives or args.codecs or args.downlink):
        real_main(args)
        return
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
    table = render(args, setup, rows, results, time.time() - started)
    print("\n" + table)
    if args.write:
        plot(rows, results, REPO / "bench" / "quality.png")
        write_section(ALTERNATIVES_SECTION, table)


def render(args, setup, rows, results, elapsed_s) -> str:
    def mean(index):
        return statistics.mean(r.final_eval for r in results[index])

    names = [m.name for m in rows]
    sync = mean(names.index("synchronous DiLoCo")) if "synchronous DiLoCo" in names else None
    dp = mean(names.index("data-parallel")) if "data-parallel" in names else None
    command = shown_command("python bench/quality.py")
    lines = [
        ALTERNATIVES_SECTION,
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
