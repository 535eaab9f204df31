"""The cluster simulator (``sim/cluster``): checked out of sample against the real runs of
``bench/goodput.py``, then run at the paper's chip scale and at the seed's 12B / four regions /
2–5 Gbit/s setting. No JAX; seconds.

1. **Fit, then predict other runs.** The runs of ``bench/results/goodput.json`` split in two.
   The **fit set** is the runs of one seed (``--fit-seed``) without a link cap: from them come
   the figures the simulator cannot derive (a killed unit's restart time, from the decoupled
   runs with failures; the outer's seconds per round of sync and dp-like, from their runs
   without failures) and each method's healthy unit speeds. The **held-out set** is every other
   run (other seeds, other failure schedules, the throttled link): each is simulated with the
   fit set's figures and speeds and only its own conditions (the link, the seeded failure
   schedule, the budget), and only these predictions are scored.
2. **Chip scale** (model output): chips with a mean time between interruptions of one year
   each, 150k to 2.4M chips; plain data-parallel (restart on every failure), elastic
   data-parallel (stall on a failure and on the chip's return), synchronous DiLoCo and
   Decoupled DiLoCo with M = 8 elastic learners. The stall and restart times are fitted to the
   paper's elastic and plain data-parallel goodput at 1.2M chips (two figures of a secondary
   summary); every other cell is the model's output, not a measurement.
3. **12B over four regions** (model output): wall-clock per 1,000 inner steps of each method at
   2 and 5 Gbit/s, from assumed step and merge times.

Raw results: ``bench/results/scaling.json``.

    .venv/bin/python bench/scaling.py --write
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

from evidence import Claim, Provenance, exit_on, render_claims, results_path, save
from goodput_results import GoodputRun
from goodput_results import load as load_goodput
from pydantic import BaseModel
from report import write_section

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared.model_config import get_config
from sim.cluster import scenarios
from sim.cluster.engine import simulate
from sim.cluster.scenarios import CHIP_COUNTS, PAPER_GOODPUT, Calibration, ChipScale, TwelveB

SECTION = "## Scaling (simulated)"
PLOT = REPO / "bench" / "scaling.png"
GOODPUT = REPO / "bench" / "results" / "goodput.json"
NAME = "scaling"
PROGRAM = ".venv/bin/python bench/scaling.py"
DECOUPLED_MERGE_S = 0.1  # assumed: far from the outer's limit at these upload rates
CHIP_METHODS = ("data-parallel", "elastic data-parallel", "sync DiLoCo M=8", "decoupled M=8")
MAX_MEAN_ERROR_PP = 5.0  # reported: held-out goodput predictions' mean absolute error, pp


class Prediction(BaseModel):
    """One held-out run: what it measured and what the fitted simulator predicted."""

    key: str
    commit: str
    real: float | None
    sim: float
    real_up: float | None
    sim_up: float
    real_window: float
    sim_window: float
    cut_off: bool


class ScalingResults(BaseModel):
    """``bench/results/scaling.json``."""

    provenance: Provenance
    fit_runs: list[str]
    restart_s: float
    merge_s: dict[str, float]
    predictions: list[Prediction]
    chip_inputs: dict[str, float]
    chip_goodput: dict[str, list[float]]
    twelve_b: list[dict[str, float | str]]
    twelve_b_inputs: dict[str, float]
    link_share: dict[str, float]


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def split(runs: list[GoodputRun], fit_seed: int) -> tuple[list[GoodputRun], list[GoodputRun]]:
    """The fit set (the fit seed's runs without a link cap) and the held-out set (the rest)."""
    fit = [r for r in runs if r.seed == fit_seed and r.link is None]
    return fit, [r for r in runs if r not in fit]


def calibrate(fit: list[GoodputRun], model: str) -> Calibration:
    """The restart time and the outer's seconds per round, fitted on the fit set only."""
    fp32 = 4 * sum(math.prod(s) for s in get_config(model).param_shapes().values())
    int8 = next(r.upload_bytes for r in fit if r.method == "decoupled" and r.upload_bytes)
    restart = scenarios.fit_restart_s(
        [r for r in fit if r.method == "decoupled" and r.mtbf_s is not None]
    )
    calibration = Calibration(
        restart_s=restart,
        merge_s={"decoupled": DECOUPLED_MERGE_S, "sync": 0.0, "dp-like": 0.0},
        params_bytes={"decoupled": int8, "sync": int8, "dp-like": fp32},
    )
    merge = dict(calibration.merge_s)
    for method in ("sync", "dp-like"):
        base = next((r for r in fit if r.method == method and r.mtbf_s is None), None)
        if base is not None:
            merge[method] = scenarios.fit_merge_s(base, calibration)
    return dataclasses.replace(calibration, merge_s=merge)


def as_predicted(run: GoodputRun, fit: list[GoodputRun]) -> GoodputRun:
    """The held-out run as the simulator may see it: its conditions (link, failures, budget)
    with the unit speeds and upload size of the fit set's run of its method without failures
    (its own measured speeds are an outcome, not an input)."""
    base = next((r for r in fit if r.method == run.method and r.mtbf_s is None), None)
    if base is None:
        return run
    return run.model_copy(update={"speeds": base.speeds, "upload_bytes": base.upload_bytes})


def predict(held: list[GoodputRun], fit: list[GoodputRun], c: Calibration) -> list[Prediction]:
    """Real against predicted goodput, per held-out run."""
    out = []
    for run in held:
        outcome = simulate(scenarios.small_cluster(as_predicted(run, fit), c))
        out.append(
            Prediction(
                key=run.key,
                commit=run.commit,
                real=run.goodput,
                sim=outcome.goodput,
                real_up=run.up,
                sim_up=outcome.up,
                real_window=scenarios.mean_window_s(run),
                sim_window=sum(outcome.windows_s) / len(outcome.windows_s),
                cut_off=run.reason != "finished",
            )
        )
    return out


def errors_pp(predictions: list[Prediction]) -> list[float]:
    """Absolute prediction errors in percentage points, of the runs that ran their budget."""
    return [
        abs(100 * (p.sim - p.real)) for p in predictions if p.real is not None and not p.cut_off
    ]


def condition(key: str) -> str:
    """A run's key without its method: the conditions the methods share."""
    return key.split(" / ", 1)[1]


def rankings(predictions: list[Prediction]) -> dict[str, tuple[list[str], list[str]]]:
    """Per held-out condition with two or more scored methods: the methods by real goodput and
    by predicted goodput, best first."""
    groups: dict[str, list[Prediction]] = {}
    for p in predictions:
        if p.real is not None and not p.cut_off:
            groups.setdefault(condition(p.key), []).append(p)
    out = {}
    for name, group in groups.items():
        if len(group) > 1:
            method = lambda p: p.key.split(" / ", 1)[0]  # noqa: E731
            real = [method(p) for p in sorted(group, key=lambda p: -(p.real or 0.0))]
            sim = [method(p) for p in sorted(group, key=lambda p: -p.sim)]
            out[name] = (real, sim)
    return out


def claims(results: ScalingResults) -> list[Claim]:
    """The model is used for how methods compare (chip scale), not for their values: it must
    rank the methods as the real system did in every held-out condition."""
    ranked = rankings(results.predictions)
    wrong = [name for name, (real, sim) in ranked.items() if real != sim]
    return [
        Claim(
            "the model ranks the methods by goodput as the real system did, in every held-out "
            "condition",
            f"{len(ranked) - len(wrong)} of {len(ranked)} conditions"
            + (f"; not: {', '.join(wrong)}" if wrong else ""),
            None if not ranked else not wrong,
        )
    ]


def chip_sweep(c: ChipScale) -> dict[str, list[float]]:
    return {
        method: [scenarios.chip_scale(method, chips, c).goodput for chips in CHIP_COUNTS]
        for method in CHIP_METHODS
    }


def twelve_b_table(t: TwelveB) -> list[dict]:
    rows = []
    for gbit in (2.0, 5.0):
        outcomes = {
            m: scenarios.twelve_b(m, gbit, t) for m in ("data-parallel", "sync DiLoCo", "decoupled")
        }
        fastest = outcomes["decoupled"].end_s
        for method, outcome in outcomes.items():
            rows.append(
                {
                    "gbit": gbit,
                    "method": method,
                    "per_1000_steps_s": outcome.end_s / t.steps * 1000,
                    "vs_decoupled": outcome.end_s / fastest,
                }
            )
    return rows


def decoupled_link_share(t: TwelveB, gbit: float) -> float:
    """The busier direction's share of a sync period a decoupled region's link is busy."""
    down = t.params * 65 / 64 * 8 / (gbit * 1e9)
    return down / (t.h_steps * t.step_s)


def plot(sweep: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c / 1e6 for c in CHIP_COUNTS]
    for method, values in sweep.items():
        (line,) = ax.plot(xs, values, "o-", label=f"{method} (simulated)")
        if method in PAPER_GOODPUT:
            ax.plot(
                xs, PAPER_GOODPUT[method], "x:", color=line.get_color(), label=f"{method} (paper)"
            )
    ax.set_xscale("log")
    ax.set_xlabel("chips (millions), MTBI 1 year per chip")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def render(results: ScalingResults, checked: list[Claim], path: Path) -> str:
    p = results.provenance
    chip = results.chip_inputs
    lines = [
        SECTION,
        "",
        p.line(path) + " `sim/cluster`, a discrete-event model of whole clusters "
        "(docs/SCALING.md); no JAX.",
        "",
        "**Out-of-sample check against `bench/goodput.py`** "
        f"(`{p.configuration.get('goodput', GOODPUT.relative_to(REPO))}`). Fit "
        f"set: {', '.join(f'`{k}`' for k in results.fit_runs)}. Fitted on it: a killed unit's "
        f"restart time {results.restart_s:.1f} s (the decoupled runs with failures: measured "
        "down time beyond the scheduled repairs, per kill); the outer's seconds per round of "
        f"sync {results.merge_s['sync']:.2f} s and of dp-like {results.merge_s['dp-like']:.2f} s "
        "(their runs without failures: the simulated units end when the real ones did); each "
        "method's unit speeds and upload size. Assumed: decoupled "
        f"{results.merge_s['decoupled']:g} s per merge. Each held-out run below is predicted "
        "from those and its own conditions only (seed, failure schedule, link, budget); no "
        "held-out figure enters the fit.",
        "",
        "| held-out run | goodput real | goodput predicted | error pp | up real / predicted "
        "| units' mean window s real / predicted | commit |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results.predictions:
        diff = None if row.real is None else 100 * (row.sim - row.real)
        note = " (cut off: not scored)" if row.cut_off else ""
        lines.append(
            f"| {row.key}{note} | {_f(row.real, '.3f')} | {row.sim:.3f} | {_f(diff, '+.1f')} "
            f"| {_f(row.real_up, '.3f')} / {row.sim_up:.3f} "
            f"| {row.real_window:.0f} / {row.sim_window:.0f} | {row.commit} |"
        )
    errors = errors_pp(results.predictions)
    if errors:
        lines += [
            "",
            f"Held-out prediction errors ({len(errors)} runs): mean {statistics.fmean(errors):.1f} "
            f"pp, largest {max(errors):.1f} pp; {sum(e <= 5 for e in errors)} within 5 pp. Mean "
            f"absolute error within {MAX_MEAN_ERROR_PP:g} pp: "
            f"{'yes' if statistics.fmean(errors) <= MAX_MEAN_ERROR_PP else 'no'}.",
        ]
    lines += [
        "",
        "**Chip scale — model output, not a measurement.** Inputs: MTBI 1 year per chip and the "
        "chip counts (the paper, via secondary sources: `../shared/research/algorithms.md` "
        f"§1.7–1.8); step {chip['step_s']:g} s, H = {chip['h_steps']:.0f}, a failed chip returns "
        f"after {chip['repair_s']:.0f} s, synchronous DiLoCo's timeout "
        f"{chip['sync_timeout_s']:g} s (assumed); {chip['horizon_s'] / 3600:.0f} h simulated per "
        f"point. Fitted to two figures of one summary of the paper, at 1.2M chips: an elastic "
        f"slice stalls {chip['stall_s']:.1f} s on a failure and again on the chip's return "
        f"(elastic data-parallel → 58%); plain data-parallel restarts in "
        f"{chip['restart_s']:.1f} s (→ 27%). Every other cell is the model's output; the "
        "paper's figures (the same summary's Table 1) are in brackets for comparison.",
        "",
        "| method | " + " | ".join(f"{c / 1e6:g}M chips" for c in CHIP_COUNTS) + " |",
        "|---|" + "---|" * len(CHIP_COUNTS),
    ]
    for method, values in results.chip_goodput.items():
        paper = PAPER_GOODPUT.get(method)
        cells = [f"{v:.0%}" + (f" [{paper[i]:.0%}]" if paper else "") for i, v in enumerate(values)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    t = results.twelve_b_inputs
    lines += [
        "",
        f"![goodput vs chips]({PLOT.relative_to(REPO)})",
        "",
        f"**12B over four regions — model output** (the seed's setting). Inputs: "
        f"{t['params'] / 1e9:.0f}B parameters, {t['regions']:.0f} regions, one inner step "
        f"{t['step_s']:g} s of compute (assumed), H = {t['h_steps']:.0f} (assumed), "
        f"{t['latency_s'] * 1000:.0f} ms between regions (assumed), the decoupled outer applies "
        f"an update in {t['merge_s']:g} s (assumed). Data-parallel: a ring all-reduce of bf16 "
        "gradients every step; synchronous DiLoCo: the same of bf16 pseudo-gradients every H "
        "steps; decoupled: int4 uploads and int8 globals, never waited for "
        f"({t['steps']:,.0f} steps simulated, no failures).",
        "",
        "| link per region | method | wall-clock per 1,000 steps | vs decoupled |",
        "|---|---|---|---|",
    ]
    for row in results.twelve_b:
        lines.append(
            f"| {row['gbit']:g} Gbit/s | {row['method']} | "
            f"{float(row['per_1000_steps_s']) / 3600:,.2f} h | {row['vs_decoupled']:,.1f}× |"
        )
    share = results.link_share
    lines += [
        "",
        f"A decoupled region's downlink is busy {share['2']:.0%} of a sync period at 2 Gbit/s "
        f"and {share['5']:.0%} at 5 Gbit/s (one int8 global per period), so communication "
        "stays hidden behind compute.",
        "",
        render_claims(checked),
    ]
    return "\n".join(lines)


def measure(args: argparse.Namespace, path: Path) -> ScalingResults:
    shown = args.goodput.resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
    configuration = {"model": args.model, "fit_seed": args.fit_seed, "goodput": str(shown)}
    provenance = Provenance.start(PROGRAM, configuration, path)
    started = time.monotonic()
    runs = list(load_goodput(args.goodput).runs.values())
    fit, held = split(runs, args.fit_seed)
    calibration = calibrate(fit, args.model)
    fitted_c = scenarios.fit_chip_scale(ChipScale())
    t = TwelveB()
    results = ScalingResults(
        provenance=provenance,
        fit_runs=[r.key for r in fit],
        restart_s=calibration.restart_s,
        merge_s=calibration.merge_s,
        predictions=predict(held, fit, calibration),
        chip_inputs={k: float(v) for k, v in dataclasses.asdict(fitted_c).items()},
        chip_goodput=chip_sweep(fitted_c),
        twelve_b=twelve_b_table(t),
        twelve_b_inputs={k: float(v) for k, v in dataclasses.asdict(t).items()},
        link_share={"2": decoupled_link_share(t, 2.0), "5": decoupled_link_share(t, 5.0)},
    )
    results.provenance.seconds = round(time.monotonic() - started, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="the model of the goodput runs")
    parser.add_argument("--goodput", type=Path, default=GOODPUT, help="the real runs")
    parser.add_argument("--fit-seed", type=int, default=1, help="the seed of the fit set")
    parser.add_argument("--render", action="store_true", help="run nothing: render the stored")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md + plot")
    parser.add_argument("--quick", action="store_true", help="smoke run (results elsewhere)")
    args = parser.parse_args()
    path = results_path(NAME, args.quick)
    if args.render:
        if not path.exists():
            raise SystemExit(f"{path}: no stored results (run bench/scaling.py first)")
        results = ScalingResults.model_validate_json(path.read_text())
    else:
        results = measure(args, path)
        save(path, results)
    checked = claims(results)
    text = render(results, checked, path)
    print(text)
    if args.write and not args.quick:
        plot(results.chip_goodput, PLOT)
        write_section(SECTION, text)
    exit_on(checked, args.quick)


if __name__ == "__main__":
    main()
