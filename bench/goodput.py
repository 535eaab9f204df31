"""Goodput and time-to-quality under failures and over a throttled link: the decoupled default
against synchronous DiLoCo and a data-parallel-like baseline, in the real system.

One ``diloco up`` run per row, all with the same model, units, inner steps per unit (the token
budget), data and seed:

* **decoupled**: the defaults;
* **sync**: synchronous DiLoCo (``--mode sync``): every unit waits at its sync point for the
  merged global of all live units; a unit missing ``--sync-timeout-s`` after a round's first
  upload is dropped from that round;
* **dp-like**: a parameter server (``--mode sync --h-steps 1`` with fp32 uploads and params,
  outer SGD with learning rate 1: every step's update is the units' average).

Failure rates (``diloco up --chaos-mtbf-s``, the same seeded schedule for every method of a
rate): each unit fails after an exponential time with the given mean, for an exponential time
with mean ``--mttr-s``, as a ``kill -9``, a pause or a link cut (every unit reaches NATS through
its own ``diloco link``; "unshaped": without a rate cap). The highest rate runs again, decoupled
and sync, with each of ``--extra-seeds`` (other data orders and failure schedules). Then the
methods again with every unit behind each throttled link of ``--throttled``, without failures;
the data-parallel-like run there is cut off after ``--dp-throttled-s`` and its time to the target
is extrapolated from its measured seconds per step.

Every figure comes from the run's ``summary.json``:

* goodput: tokens the outer applied over what the units could have trained in their windows at
  their healthy speeds (``shared/goodput.py``), and the share of the windows the units were up
  (training, not dead or paused); "goodput / up" is their ratio;
* the held-out eval loss at equal wall-clock (the shortest run of the rate, from the units'
  start) and the wall-clock from the start to the target eval loss.

Each row's figures are kept in ``bench/results/goodput.json``, which ``bench/scaling.py`` checks
its simulator against.

    .venv/bin/python bench/goodput.py --write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cluster import up_command  # bench/ is on sys.path when run as a script
from report import shown_command, write_section

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.orchestration.local.records import RunSummary
from sim.cluster.model import GoodputRun

SECTION = "## Goodput under failures"
PLOT = REPO / "bench" / "goodput.png"
RESULTS = REPO / "bench" / "results" / "goodput.json"
METHODS = {
    "decoupled": [],
    "sync": ["--mode", "sync"],
    "dp-like": [
        *("--mode", "sync", "--h-steps", "1", "--codec", "fp32", "--params-codec", "fp32"),
        *("--outer-optimizer", "sgd", "--outer-lr", "1.0", "--outer-momentum", "0"),
    ],
}


@dataclass(frozen=True)
class Row:
    """One run: a method, a failure rate (mean seconds between a unit's failures) and a link."""

    method: str
    mtbf_s: float | None
    link: str | None = None
    seed: int = 1

    @property
    def key(self) -> str:
        rate = "none" if self.mtbf_s is None else f"mtbf {self.mtbf_s:g}s"
        seed = "" if self.seed == 1 else f" / seed {self.seed}"
        return f"{self.method} / {rate} / {self.link or 'unshaped'}{seed}"


def throttled_links(args: argparse.Namespace) -> list[str]:
    return [link for link in args.throttled.split(",") if link]


def rows(args: argparse.Namespace) -> list[Row]:
    rates = [None if r == "none" else float(r) for r in args.rates.split(",")]
    methods = [m for m in METHODS if m in args.methods.split(",")]
    table = [Row(method, rate, seed=args.seed) for rate in rates for method in methods]
    # The highest rate again with other seeds (other failure schedules), decoupled against sync.
    highest = min((r for r in rates if r is not None), default=None)
    table += [
        Row(method, highest, seed=seed)
        for seed in args.extra_seeds
        for method in ("decoupled", "sync")
        if highest is not None and method in methods
    ]
    table += [
        Row(method, None, link, args.seed) for link in throttled_links(args) for method in methods
    ]
    return table


def flags(row: Row, args: argparse.Namespace) -> list[str]:
    out = [
        *("--model", args.model, "--learners", str(args.learners)),
        *("--max-steps", str(args.steps), "--h-steps", str(args.h_steps)),
        *("--sync-timeout-s", str(args.sync_timeout_s), "--seed", str(row.seed)),
        *METHODS[row.method],
    ]
    if row.mtbf_s is not None:
        out += ["--chaos-mtbf-s", str(row.mtbf_s), "--chaos-mttr-s", str(args.mttr_s)]
        out += ["--chaos-kinds", args.kinds, "--chaos-seed", str(row.seed)]
    # Unshaped rows run their units behind links without a cap too, so that a failure can cut
    # a unit's link and every rate runs the same processes.
    out += ["--links", ",".join([row.link or "unlimited"] * args.learners)]
    if row.link is not None and row.method == "dp-like":
        out += ["--max-duration-s", str(args.dp_throttled_s)]
    return out


def run(row: Row, args: argparse.Namespace, cache: Path) -> RunSummary:
    """One ``diloco up`` run; its summary."""
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "DILOCO_JAX_CACHE": str(cache)}
        result = subprocess.run(
            up_command(data_dir, *flags(row, args)),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        path = Path(data_dir, "summary.json")
        if not path.exists():
            raise SystemExit(f"{row.key}: diloco up failed:\n{result.stdout}\n{result.stderr}")
        summary = RunSummary.model_validate_json(path.read_text())
    cut_off = summary.reason.startswith("time limit")
    if summary.reason != "finished" and not (cut_off and row.method == "dp-like" and row.link):
        raise SystemExit(f"{row.key}: the run ended with {summary.reason!r}:\n{result.stdout}")
    if not cut_off and not summary.ledger.balanced:
        raise SystemExit(f"{row.key}: the books do not balance: {summary.ledger}")
    return summary


def figures(row: Row, summary: RunSummary, args: argparse.Namespace) -> GoodputRun:
    outer = summary.outer
    assert outer is not None and summary.started_at is not None and summary.goodput is not None
    start = summary.started_at
    curve = [
        (round(p.at - start, 2), p.nats_per_byte)
        for p in outer.evaluation.history
        if p.at is not None and p.nats_per_byte is not None
    ]
    some_unit = next(iter(summary.units.values()))
    end_s = curve[-1][0] if curve else summary.elapsed_s
    good = summary.goodput
    return GoodputRun(
        key=row.key,
        method=row.method,
        mtbf_s=row.mtbf_s,
        link=row.link,
        reason=summary.reason,
        elapsed_s=round(summary.elapsed_s, 1),
        goodput=good.job,
        up=good.job_up,
        unit_goodput={str(u): round(g, 4) for u, g in good.units.items()},
        unit_up={str(u): round(g, 4) for u, g in good.up.items()},
        speeds={str(u): s.compute_tokens_per_s for u, s in summary.units.items()},
        unit_applied={str(u): books.tokens for u, books in outer.units.items()},
        windows={str(u): round(w, 2) for u, w in good.windows_s.items()},
        restarts=dict(summary.restarts),
        tokens_per_step=some_unit.tokens_per_step,
        h_steps=1 if row.method == "dp-like" else args.h_steps,
        steps=args.steps,
        applied=outer.applied,
        versions=outer.version,
        upload_bytes=outer.payload_bytes / outer.applied if outer.applied else 0.0,
        end_s=end_s,
        seconds_per_version=end_s / outer.version if outer.version else None,
        final_eval=curve[-1][1] if curve else None,
        curve=curve,
        chaos=summary.chaos,
        chaos_offset_s=summary.chaos_offset_s,
    )


def eval_at(fig: GoodputRun, seconds: float) -> float | None:
    """The newest eval loss at ``seconds`` from the start (None: none yet)."""
    seen = [loss for at, loss in fig.curve if at <= seconds]
    return seen[-1] if seen else None


def time_to(fig: GoodputRun, target: float) -> float | None:
    """Seconds from the start to the first eval at or below ``target`` (None: never)."""
    return next((at for at, loss in fig.curve if loss <= target), None)


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def rate_label(mtbf_s: float | None, period_s: float | None) -> str:
    if mtbf_s is None:
        return "none"
    per = f" (~{mtbf_s / period_s:.0f} sync periods)" if period_s else ""
    return f"1 per {mtbf_s:g} s{per}"


def analyse(results: dict[Row, GoodputRun], args: argparse.Namespace) -> dict:
    """Per failure rate (the main seed): eval at equal wall-clock and time to the target; the
    highest rate per seed; per throttled link: time to the target (the parameter server's
    extrapolated when it was cut off)."""
    main = {row: f for row, f in results.items() if row.seed == args.seed}
    unshaped = {row: f for row, f in main.items() if row.link is None}
    no_failure = [f for row, f in unshaped.items() if row.mtbf_s is None]
    # The target: the quality the default reaches without failures (its final eval + 1%).
    target = args.target
    if target is None:
        default = next(f for f in no_failure if f.method == "decoupled" and f.final_eval)
        target = round(1.01 * default.final_eval, 3)
    rates = sorted({r.mtbf_s for r in unshaped}, key=lambda r: float("-inf") if r is None else -r)
    per_rate = {}
    for rate in rates:
        group = {row.method: f for row, f in unshaped.items() if row.mtbf_s == rate}
        equal = min(f.end_s for f in group.values())
        per_rate[rate] = {
            "equal_s": equal,
            "evals": {m: eval_at(f, equal) for m, f in group.items()},
            "to_target": {m: time_to(f, target) for m, f in group.items()},
        }
    highest = min((r for r in rates if r is not None), default=None)
    by_seed: dict[int, dict[str, GoodputRun]] = {}
    for row, f in results.items():
        if row.link is None and row.mtbf_s == highest and highest is not None:
            by_seed.setdefault(row.seed, {})[row.method] = f
    dp_unshaped = next((f for f in no_failure if f.method == "dp-like"), None)
    steps_needed = None
    if dp_unshaped is not None and dp_unshaped.seconds_per_version:
        steps_needed = next(
            (
                at / dp_unshaped.seconds_per_version
                for at, loss in dp_unshaped.curve
                if loss <= target
            ),
            None,
        )
    throttled = {}
    for link in throttled_links(args):
        group = {row.method: f for row, f in main.items() if row.link == link}
        dp = group.get("dp-like")
        extrapolated = None
        if dp is not None and steps_needed is not None and dp.seconds_per_version is not None:
            extrapolated = steps_needed * dp.seconds_per_version
        throttled[link] = {"runs": group, "dp_extrapolated_s": extrapolated}
    return {
        "target": target,
        "per_rate": per_rate,
        "highest": highest,
        "by_seed": by_seed,
        "throttled": throttled,
    }


def table(results: dict[Row, GoodputRun], args, analysis: dict, elapsed_s: float, command: str):
    decoupled = next(
        f for row, f in results.items() if row.method == "decoupled" and row.link is None
    )
    speed = sum(decoupled.speeds.values()) / len(decoupled.speeds)
    period = args.h_steps * decoupled.tokens_per_step / speed if speed else None
    target = analysis["target"]
    target_source = (
        "given with `--target`"
        if args.target is not None
        else "the decoupled final eval without failures + 1%"
    )
    lines = [
        SECTION,
        "",
        f"`{command}` — `diloco up` with model `{args.model}`, {args.learners} learners (each "
        "behind its own `diloco link`, without a cap unless throttled), "
        f"{args.steps} inner steps each (the same token budget for every method), H="
        f"{args.h_steps} (a sync period of about {_f(period, '.0f')} s), seed {args.seed}. "
        "Methods: decoupled (the defaults); sync (`--mode sync --sync-timeout-s "
        f"{args.sync_timeout_s:g}`); dp-like (a parameter server: `--mode sync --h-steps 1 "
        "--codec fp32 --params-codec fp32 --outer-optimizer sgd --outer-lr 1.0`). Failures: "
        f"each unit fails after an exponential time of the given mean for an exponential time "
        f"of mean {args.mttr_s:g} s, as one of {args.kinds} (`--chaos-*`, seeded, "
        "the same schedule for every method of a rate and seed). Goodput: applied tokens over "
        "what the units could have trained in their windows at their healthy speeds; up: the "
        "share of the windows the units spent training (not dead or paused). Eval at equal "
        "wall-clock: the held-out loss of each method at the end of the rate's shortest run; "
        f"time to target: from the units' start to the first eval ≤ {target:.3f} nats/byte "
        f"({target_source}; '-': not reached). "
        f"Runs: {elapsed_s / 60:.0f} min in all on "
        f"{os.cpu_count()} cores.",
        "",
        "| failures | method | goodput | up | goodput / up | applied | eval at equal wall-clock "
        "(s) | time to target s | final eval | run s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, facts in analysis["per_rate"].items():
        for method in METHODS:
            fig = results.get(Row(method, rate, seed=args.seed))
            if fig is None:
                continue
            ratio = fig.goodput / fig.up if fig.goodput and fig.up else None
            lines.append(
                f"| {rate_label(rate, period)} | {method} | {_f(fig.goodput, '.3f')} "
                f"| {_f(fig.up, '.3f')} | {_f(ratio, '.2f')} | {fig.applied} "
                f"| {_f(facts['evals'][method], '.3f')} ({facts['equal_s']:.0f}) "
                f"| {_f(facts['to_target'][method], '.0f')} | {_f(fig.final_eval, '.3f')} "
                f"| {fig.end_s:.0f} |"
            )
    by_seed = analysis["by_seed"]
    if len(by_seed) > 1:
        lines += [
            "",
            f"The highest rate ({rate_label(analysis['highest'], period)}) with each seed "
            "(data order and failure schedule):",
            "",
            "| seed | decoupled goodput (up) | sync goodput (up) | decoupled / sync "
            "| eval at equal wall-clock, decoupled / sync (s) |",
            "|---|---|---|---|---|",
        ]
        ratios = []
        for seed, group in sorted(by_seed.items()):
            d, y = group.get("decoupled"), group.get("sync")
            if d is None or y is None:
                continue
            ratio = d.goodput / y.goodput if d.goodput and y.goodput else None
            if ratio is not None:
                ratios.append(ratio)
            equal = min(d.end_s, y.end_s)
            lines.append(
                f"| {seed} | {_f(d.goodput, '.3f')} ({_f(d.up, '.3f')}) "
                f"| {_f(y.goodput, '.3f')} ({_f(y.up, '.3f')}) | {_f(ratio, '.2f')}× "
                f"| {_f(eval_at(d, equal), '.3f')} / {_f(eval_at(y, equal), '.3f')} "
                f"({equal:.0f}) |"
            )
        if ratios:
            lines.append(f"| mean | | | {sum(ratios) / len(ratios):.2f}× | |")
    for link, facts in analysis["throttled"].items():
        runs = facts["runs"]
        if not runs:
            continue
        lines += [
            "",
            f"Over a throttled link ({link} per unit, each direction), without failures:",
            "",
            "| method | s per global version | time to target s | vs decoupled | final eval "
            "| run s |",
            "|---|---|---|---|---|---|",
        ]
        fastest = time_to(runs["decoupled"], target) if "decoupled" in runs else None
        for method, fig in runs.items():
            to_target = time_to(fig, target)
            shown = _f(to_target, ",.0f")
            if method == "dp-like" and to_target is None:
                to_target = facts["dp_extrapolated_s"]
                shown = f"{_f(to_target, ',.0f')} (extrapolated)"
            ratio = to_target / fastest if to_target is not None and fastest else None
            cut = " (cut off)" if fig.reason != "finished" else ""
            lines.append(
                f"| {method} | {_f(fig.seconds_per_version, '.2f')} | {shown} "
                f"| {_f(ratio, '.1f')}× | {_f(fig.final_eval, '.3f')} | {fig.end_s:.0f}{cut} |"
            )
    lines += ["", f"![goodput vs failure rate]({PLOT.relative_to(REPO)})", ""]
    return "\n".join(lines)


def plot(results: dict[Row, GoodputRun], seed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    unshaped = [f for row, f in results.items() if row.link is None and row.seed == seed]
    for method in METHODS:
        points = sorted(
            ((0.0 if f.mtbf_s is None else 3600 / f.mtbf_s), f.goodput)
            for f in unshaped
            if f.method == method and f.goodput is not None
        )
        ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=method)
    ups = sorted(
        ((0.0 if f.mtbf_s is None else 3600 / f.mtbf_s), f.up)
        for f in unshaped
        if f.method == "decoupled" and f.up is not None
    )
    ax.plot([x for x, _ in ups], [y for _, y in ups], "k:", label="up share (decoupled)")
    ax.set_xlabel("failures per unit-hour")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def load(path: Path) -> dict[str, GoodputRun]:
    if not path.exists():
        return {}
    return {k: GoodputRun.model_validate(v) for k, v in json.loads(path.read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300, help="inner steps per unit")
    parser.add_argument("--h-steps", type=int, default=30)
    parser.add_argument("--rates", default="none,120,30", help="MTBF seconds per unit, or none")
    parser.add_argument("--mttr-s", type=float, default=10.0)
    parser.add_argument("--kinds", default="kill,pause,cut")
    parser.add_argument("--sync-timeout-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1, help="seeds the data and the failures")
    parser.add_argument(
        "--extra-seeds",
        type=lambda text: [int(seed) for seed in text.split(",") if seed],
        default=[],
        help="more seeds for decoupled and sync at the highest rate (e.g. 2,3)",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="which methods to run")
    parser.add_argument(
        "--throttled", default="2mbit/25ms", help="every unit's link; several: comma-separated"
    )
    parser.add_argument("--dp-throttled-s", type=float, default=240.0)
    parser.add_argument("--target", type=float, default=None, help="target eval (nats/byte)")
    parser.add_argument("--reuse", action="store_true", help="keep rows already in the results")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md + plot")
    args = parser.parse_args()
    command = shown_command(".venv/bin/python bench/goodput.py")
    all_rows = rows(args)
    cache = Path(tempfile.mkdtemp(prefix="goodput-jax-cache-"))
    results = load(RESULTS) if args.reuse else {}
    for row in all_rows:
        if row.key in results:
            continue
        t0 = time.time()
        results[row.key] = figures(row, run(row, args, cache), args)
        fig = results[row.key]
        print(
            f"{row.key:40s} goodput {_f(fig.goodput, '.3f')} up {_f(fig.up, '.3f')} "
            f"final {_f(fig.final_eval, '.3f')} at {fig.end_s:.0f}s ({time.time() - t0:.0f}s)",
            flush=True,
        )
        RESULTS.parent.mkdir(exist_ok=True)
        rows_json = {k: v.model_dump(mode="json") for k, v in results.items()}
        RESULTS.write_text(json.dumps(rows_json, indent=1))
    chosen = {row: results[row.key] for row in all_rows}
    analysis = analyse(chosen, args)
    text = table(chosen, args, analysis, sum(f.elapsed_s for f in chosen.values()), command)
    print("\n" + text)
    if args.write:
        plot(chosen, args.seed, PLOT)
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
