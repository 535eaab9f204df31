"""The real system against synchronous DiLoCo and a parameter server: final quality at equal
tokens, time to a target quality (measured to the target, on fast and on slow links), and
goodput and progress under failures.

One ``diloco up`` run per row, all with the same model, units, inner steps per unit (the token
budget) and data of their seed:

* **decoupled**: the shipped defaults;
* **sync**: synchronous DiLoCo (``--mode sync``): every unit waits at its sync point for the
  merged global of all live units; a unit missing ``--sync-timeout-s`` after a round's first
  upload is dropped from that round;
* **dp-like**: a parameter server (``--mode sync --h-steps 1`` with fp32 uploads and params,
  outer SGD with learning rate 1: every step's update is the units' average).

The rows, in the order they run (``--reuse`` keeps the stored ones):

1. **Quality**: every method without failures, each of ``--seeds`` (data orders); the first,
   decoupled with the first seed, defines the **target** before any other run: its final eval
   + 2% (``TARGET_MARGIN``), stored with the results.
2. **Slow link**: every method with every unit behind ``--throttled`` (each direction), without
   failures; the parameter server runs until it reaches the target (``diloco up
   --stop-at-eval``) or ``--dp-max-s``. The link is chosen so that the parameter server's
   communication is ≥ 10× its compute (a claim, measured: its seconds per version on the link
   less those without a cap, over its compute seconds per step).
3. **Failures**: each rate of ``--rates`` (``diloco up --chaos-mtbf-s``, the same seeded
   schedule for every method of a rate and seed): each unit fails after an exponential time
   with the given mean, for an exponential time with mean ``--mttr-s``, as a ``kill -9``, a
   pause or a link cut (every unit reaches NATS through its own ``diloco link``; "unshaped":
   without a rate cap). The highest rate runs again, decoupled and sync, with each of
   ``--extra-seeds``.

Every figure comes from the runs' ``summary.json``: goodput (tokens the outer applied over what
the units could have trained in their windows at their healthy speeds, ``shared/goodput.py``),
the share of the windows the units were up, the held-out eval curve, the time from the units'
start to the target. Raw figures of every run, with its commit: ``bench/results/goodput.json``,
which ``bench/quality.py`` (the quality table and its simulated twin) and ``bench/scaling.py``
(the cluster simulator's check) read too.

    .venv/bin/python bench/goodput.py --write            # every row (about 70 min on 2 cores)
    .venv/bin/python bench/goodput.py --render --write   # the section from the stored runs
    .venv/bin/python bench/goodput.py --quick            # the smoke version (tiny model)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cluster import up_command  # bench/ is on sys.path when run as a script
from evidence import (
    Claim,
    Provenance,
    at_least,
    exit_on,
    note,
    render_claims,
    results_path,
    save,
)
from goodput_results import GoodputResults, Target, load
from report import commit, write_section

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.orchestration.local.records import RunSummary
from sim.cluster.model import GoodputRun

SECTION = "## Time to target and goodput under failures"
PLOT = REPO / "bench" / "goodput.png"
NAME = "goodput"
PROGRAM = ".venv/bin/python bench/goodput.py"
TARGET_MARGIN = 1.02  # the target: the decoupled final eval without failures, + 2%
MIN_COMM_OVER_COMPUTE = 10.0  # the parameter server's link time over its compute, on the link
METHODS = {
    "decoupled": [],
    "sync": ["--mode", "sync"],
    "dp-like": [
        *("--mode", "sync", "--h-steps", "1", "--codec", "fp32", "--params-codec", "fp32"),
        *("--outer-optimizer", "sgd", "--outer-lr", "1.0", "--outer-momentum", "0"),
        # fp32 copies down, as a parameter server sends; and no norm guard: its reference, the
        # first merged norms, comes from the warm-up's first steps (learning rate near 0), so
        # it rejected every later step as an outlier.
        *("--params-downlink", "copy", "--norm-guard", "off"),
    ],
}


@dataclass(frozen=True)
class Row:
    """One run: a method, a failure rate (mean seconds between a unit's failures), a link and a
    seed."""

    method: str
    mtbf_s: float | None
    link: str | None = None
    seed: int = 1

    @property
    def key(self) -> str:
        rate = "none" if self.mtbf_s is None else f"mtbf {self.mtbf_s:g}s"
        return f"{self.method} / {rate} / {self.link or 'unshaped'} / seed {self.seed}"


def rows(args: argparse.Namespace) -> list[Row]:
    """Every run, in the order they run: the first defines the target."""
    methods = [m for m in METHODS if m in args.methods.split(",")]
    seeds = [args.seed, *args.seeds]
    out = [Row(method, None, seed=seed) for seed in dict.fromkeys(seeds) for method in methods]
    out += [Row(method, None, link, args.seed) for link in links(args) for method in methods]
    rates = rates_of(args)
    out += [Row(method, rate, seed=args.seed) for rate in rates for method in methods]
    highest = min(rates, default=None)
    out += [
        Row(method, highest, seed=seed)
        for seed in args.extra_seeds
        for method in ("decoupled", "sync")
        if highest is not None and method in methods
    ]
    return out


def links(args: argparse.Namespace) -> list[str]:
    return [link for link in args.throttled.split(",") if link]


def rates_of(args: argparse.Namespace) -> list[float]:
    return [float(rate) for rate in args.rates.split(",") if rate]


def flags(row: Row, args: argparse.Namespace, target: Target | None) -> list[str]:
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
    # a unit's link and every row runs the same processes.
    out += ["--links", ",".join([row.link or "unlimited"] * args.learners)]
    if row.link is not None and row.method == "dp-like":
        assert target is not None, "the target is defined by the first run"
        out += ["--stop-at-eval", str(target.nats_per_byte), "--max-duration-s", str(args.dp_max_s)]
    return out


def run(row: Row, args: argparse.Namespace, target: Target | None, cache: Path) -> RunSummary:
    """One ``diloco up`` run; its summary."""
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "DILOCO_JAX_CACHE": str(cache)}
        result = subprocess.run(
            up_command(data_dir, *flags(row, args, target)),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.dp_max_s + 1200,
        )
        path = Path(data_dir, "summary.json")
        if not path.exists():
            raise SystemExit(f"{row.key}: diloco up failed:\n{result.stdout}\n{result.stderr}")
        summary = RunSummary.model_validate_json(path.read_text())
    stopped = summary.reason.startswith(("time limit", "target eval")) and row.method == "dp-like"
    if summary.reason != "finished" and not (stopped and row.link):
        raise SystemExit(f"{row.key}: the run ended with {summary.reason!r}:\n{result.stdout}")
    if not stopped and not summary.ledger.balanced:
        raise SystemExit(f"{row.key}: the books do not balance: {summary.ledger}")
    return summary


def figures(row: Row, summary: RunSummary, args: argparse.Namespace, code: str) -> GoodputRun:
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
        commit=code,
        seed=row.seed,
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


def define_target(first: GoodputRun, pending: list[str]) -> Target:
    """The target: the first run's (decoupled, no failures, no cap) final eval + 2%."""
    assert first.final_eval is not None, f"{first.key}: no eval"
    return Target(
        nats_per_byte=round(TARGET_MARGIN * first.final_eval, 4),
        source=f"{first.key}: final eval {first.final_eval:.4f} × {TARGET_MARGIN:g}",
        commit=first.commit,
        defined_before=pending,
    )


# ---- figures of the stored runs -------------------------------------------------------------


def eval_at(fig: GoodputRun, seconds: float) -> float | None:
    """The newest eval loss at ``seconds`` from the start (None: none yet)."""
    seen = [loss for at, loss in fig.curve if at <= seconds]
    return seen[-1] if seen else None


def time_to(fig: GoodputRun | None, target: float) -> float | None:
    """Seconds from the start to the first eval at or below ``target`` (None: never)."""
    if fig is None:
        return None
    return next((at for at, loss in fig.curve if loss <= target), None)


def kills(fig: GoodputRun) -> int:
    """The units' kills injected during the run."""
    return sum(1 for event in fig.chaos if event.kind == "kill" and event.target != "outer")


def compute_s_per_step(fig: GoodputRun) -> float | None:
    """A unit's seconds of compute per inner step, at the units' mean healthy speed."""
    speeds = [s for s in fig.speeds.values() if s]
    return fig.tokens_per_step / statistics.fmean(speeds) if speeds else None


def seconds_per_step(fig: GoodputRun) -> float | None:
    """The run's seconds per inner step: its time over the steps of each unit the outer applied
    (their mean)."""
    if not fig.unit_applied or not fig.tokens_per_step:
        return None
    steps = statistics.fmean(fig.unit_applied.values()) / fig.tokens_per_step
    return fig.end_s / steps if steps else None


def comm_over_compute(throttled: GoodputRun | None, free: GoodputRun | None) -> float | None:
    """The parameter server's link time per step over its compute per step: its seconds per
    step on the link less those without a cap, over its compute seconds per step on the link."""
    if throttled is None or free is None:
        return None
    compute = compute_s_per_step(throttled)
    linked, unlinked = seconds_per_step(throttled), seconds_per_step(free)
    if not compute or linked is None or unlinked is None:
        return None
    return (linked - unlinked) / compute


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def rate_label(mtbf_s: float | None) -> str:
    return "none" if mtbf_s is None else f"1 per {mtbf_s:g} s"


class Stored:
    """The stored runs of the rows an invocation names."""

    def __init__(self, results: GoodputResults, args: argparse.Namespace) -> None:
        self.args = args
        self.target = results.target
        self.runs = {row: results.runs[row.key] for row in rows(args) if row.key in results.runs}

    def get(
        self, method: str, mtbf_s: float | None = None, link: str | None = None, seed: int = 0
    ) -> GoodputRun | None:
        return self.runs.get(Row(method, mtbf_s, link, seed or self.args.seed))

    def commits(self) -> list[str]:
        return list(dict.fromkeys(f.commit for f in self.runs.values()))


def claims(stored: Stored) -> list[Claim]:
    """What the section claims, checked against the stored runs."""
    args, target = stored.args, stored.target
    out: list[Claim] = []
    keys = [row.key for row in stored.runs]
    defining = rows(args)[0].key
    before = set(target.defined_before) if target else set()
    judged = [k for k in keys if k != defining]
    out.append(
        Claim(
            "the target was set from the first run before any run it judges",
            f"{target.nats_per_byte:.4f} ({target.source})" if target else "no target",
            None if target is None else all(k in before for k in judged),
        )
    )
    goal = target.nats_per_byte if target else None
    for link in links(args):
        dp = stored.get("dp-like", link=link)
        free = stored.get("dp-like")
        out.append(
            at_least(
                f"{link}: the parameter server's communication ≥ {MIN_COMM_OVER_COMPUTE:g}× its "
                "compute",
                comm_over_compute(dp, free),
                MIN_COMM_OVER_COMPUTE,
                ".1f",
            )
        )
        dp_s = time_to(dp, goal) if goal else None
        out.append(
            Claim(
                f"{link}: the parameter server ran to the target (measured, not extrapolated)",
                "not measured" if dp is None else f"{_f(dp_s, '.0f')} s ({dp.reason})",
                None if dp is None else dp_s is not None,
            )
        )
        decoupled = stored.get("decoupled", link=link)
        decoupled_s = time_to(decoupled, goal) if goal else None
        text = f"{link}: decoupled reaches the target sooner than the parameter server"
        if dp_s and decoupled_s:
            out.append(at_least(text, dp_s / decoupled_s, 1.0, ".1f"))
        elif dp is not None and decoupled is not None and goal:
            # both ran: whichever did not reach the target decides it
            shown = f"decoupled {_f(decoupled_s, '.0f')} s, parameter server {_f(dp_s, '.0f')} s"
            out.append(Claim(text, shown, decoupled_s is not None))
        else:
            out.append(Claim(text, "not measured", None))
    for rate in rates_of(args):
        group = {m: stored.get(m, rate) for m in METHODS if m in args.methods.split(",")}
        for method, fig in group.items():
            out.append(
                at_least(
                    f"{rate_label(rate)}: {method} saw at least one kill",
                    None if fig is None else kills(fig),
                    1,
                    "d",
                )
            )
        decoupled = group.get("decoupled")
        for method in ("sync", "dp-like"):
            other = group.get(method)
            ratio = (
                decoupled.goodput / other.goodput
                if decoupled and other and decoupled.goodput and other.goodput
                else None
            )
            out.append(
                at_least(f"{rate_label(rate)}: decoupled goodput ≥ {method}'s", ratio, 1.0, ".2f")
            )
    return out


# ---- the section ----------------------------------------------------------------------------


def render(stored: Stored, results: GoodputResults, checked: list[Claim], path: Path) -> str:
    args, target = stored.args, stored.target
    goal = target.nats_per_byte if target else None
    some = next(iter(stored.runs.values()), None)
    speed = statistics.fmean(some.speeds.values()) if some and some.speeds else None
    period = args.h_steps * some.tokens_per_step / speed if some and speed else None
    invocations = results.provenance
    lines = [
        SECTION,
        "",
        (invocations[-1].line(path) if invocations else f"Raw results: `{path}`.")
        + (
            " Earlier invocations that made stored runs: "
            + ", ".join(f"`{p.command}` (`{p.commit}`)" for p in invocations[:-1])
            + "."
            if len(invocations) > 1
            else ""
        )
        + f" The runs are from commit{'s' if len(stored.commits()) > 1 else ''} "
        + ", ".join(f"`{c}`" for c in stored.commits())
        + " (each row names its own).",
        "",
        f"`diloco up` with model `{args.model}`, {args.learners} learners (each behind its own "
        f"`diloco link`, without a cap unless throttled), {args.steps} inner steps each (the "
        f"same token budget for every method), H={args.h_steps} (a sync period of about "
        f"{_f(period, '.0f')} s). Methods: decoupled (the shipped defaults); sync (`--mode sync "
        f"--sync-timeout-s {args.sync_timeout_s:g}`); dp-like (a parameter server: `--mode sync "
        "--h-steps 1 --codec fp32 --params-codec fp32 --outer-optimizer sgd --outer-lr 1.0 "
        "--outer-momentum 0 --params-downlink copy --norm-guard off`). **Target**: "
        + (
            f"{goal:.4f} nats/byte, set from `{target.source}` before any other run"
            if target
            else "not set yet"
        )
        + "; time to target: from the units' start to the first held-out eval at or below it "
        "(the outer evaluates every 10 s; '-': not reached).",
        "",
        "**Time to the target**, without failures. s per step: the run's time over the inner "
        "steps of each unit the outer applied; compute: a unit's seconds of compute per step at "
        "its healthy speed; ended: 'finished' (the token budget), or the parameter server "
        "stopped at the target (`--stop-at-eval`).",
        "",
        "| link | method | seed | s per step | compute s per step | time to target s "
        "| vs decoupled | final eval | run s | ended | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for link in [None, *links(args)]:
        seeds = [args.seed, *args.seeds] if link is None else [args.seed]
        for seed in dict.fromkeys(seeds):
            base = time_to(stored.get("decoupled", link=link, seed=seed), goal) if goal else None
            for method in METHODS:
                fig = stored.get(method, link=link, seed=seed)
                if fig is None:
                    continue
                reached = time_to(fig, goal) if goal else None
                ratio = reached / base if reached is not None and base else None
                lines.append(
                    f"| {link or 'no cap'} | {method} | {seed} "
                    f"| {_f(seconds_per_step(fig), '.2f')} | {_f(compute_s_per_step(fig), '.2f')} "
                    f"| {_f(reached, ',.0f')} "
                    f"| {_f(ratio, '.2f')}× | {_f(fig.final_eval, '.4f')} | {fig.end_s:,.0f} "
                    f"| {fig.reason} | {fig.commit} |"
                )
    lines += ["", *verdicts(stored)]
    lines += [
        "",
        f"**Under failures**: each unit fails after an exponential time of the given mean for an "
        f"exponential time of mean {args.mttr_s:g} s, as one of {args.kinds} (`--chaos-*`, "
        "seeded: the same schedule for every method of a rate and seed). Kills: the units' kills "
        "that fell within the run. Goodput: applied tokens over what the units could have "
        "trained in their windows at their healthy speeds; up: the share of the windows the "
        "units spent training. Progress: the time to the target over the same method's without "
        "failures (seed "
        f"{args.seed}); eval at equal wall-clock: each method's held-out loss at the end of the "
        "rate's shortest run.",
        "",
        "| failures | method | kills | goodput | up | goodput / up | time to target s "
        "| vs no failures | eval at equal wall-clock (s) | final eval | run s | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in [None, *rates_of(args)]:
        group = {m: f for m in METHODS if (f := stored.get(m, rate)) is not None}
        if not group:
            continue
        equal = min(f.end_s for f in group.values())
        for method, fig in group.items():
            ratio = fig.goodput / fig.up if fig.goodput and fig.up else None
            reached = time_to(fig, goal) if goal else None
            calm = time_to(stored.get(method), goal) if goal else None
            slower = reached / calm if reached is not None and calm else None
            lines.append(
                f"| {rate_label(rate)} | {method} | {kills(fig)} | {_f(fig.goodput, '.3f')} "
                f"| {_f(fig.up, '.3f')} | {_f(ratio, '.2f')} | {_f(reached, ',.0f')} "
                f"| {_f(slower, '.2f')}× | {_f(eval_at(fig, equal), '.3f')} ({equal:.0f}) "
                f"| {_f(fig.final_eval, '.3f')} | {fig.end_s:,.0f} | {fig.commit} |"
            )
    highest = min(rates_of(args), default=None)
    if highest is not None and args.extra_seeds:
        lines += [
            "",
            f"The highest rate ({rate_label(highest)}) with each seed (data order and failure "
            "schedule):",
            "",
            "| seed | decoupled goodput (up) | sync goodput (up) | decoupled / sync "
            "| eval at equal wall-clock, decoupled / sync (s) |",
            "|---|---|---|---|---|",
        ]
        ratios = []
        for seed in [args.seed, *args.extra_seeds]:
            d, y = (
                stored.get("decoupled", highest, seed=seed),
                stored.get("sync", highest, seed=seed),
            )
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
            lines.append(f"| mean | | | {statistics.fmean(ratios):.2f}× | |")
    lines += [
        "",
        render_claims(checked),
        f"![goodput vs failure rate]({PLOT.relative_to(REPO)})",
        "",
    ]
    return "\n".join(lines)


def verdicts(stored: Stored) -> list[str]:
    """Who reaches the target first, decoupled or the parameter server: without a cap (each seed,
    and the mean ratio over the seeds where both reached it) and on each link."""
    args, target = stored.args, stored.target
    if target is None:
        return []
    out = []
    for link in [None, *links(args)]:
        seeds = list(dict.fromkeys([args.seed, *args.seeds])) if link is None else [args.seed]
        ratios, missed = [], []
        for seed in seeds:
            d = time_to(stored.get("decoupled", link=link, seed=seed), target.nats_per_byte)
            p = time_to(stored.get("dp-like", link=link, seed=seed), target.nats_per_byte)
            if d is None or p is None:
                missed.append(seed)
            else:
                ratios.append(p / d)
        where = f"Over {link}" if link else "Without a cap"
        seen = (
            f" ({len(ratios)} of {len(seeds)} seeds; seed {', '.join(map(str, missed))}: "
            "not both reached the target)"
            if missed
            else ""
        )
        if not ratios:
            out.append(f"- {where}: not both reached the target.")
            continue
        mean = statistics.fmean(ratios)
        if mean < 1:
            out.append(
                f"- {where} **the parameter server wins**: it reaches the target in "
                f"{mean:.2f}× decoupled's time, {1 / mean:.2f}× sooner{seen}."
            )
        else:
            out.append(
                f"- {where} **decoupled wins**: the parameter server takes {mean:.1f}× "
                f"decoupled's time to the target{seen}."
            )
    return out


def plot(stored: Stored, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        points = sorted(
            ((0.0 if rate is None else 3600 / rate), f.goodput)
            for rate in [None, *rates_of(stored.args)]
            if (f := stored.get(method, rate)) is not None and f.goodput is not None
        )
        ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=method)
    ax.set_xlabel("failures per unit-hour")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out.add_argument("--model", default="small")
    out.add_argument("--learners", type=int, default=4)
    out.add_argument("--steps", type=int, default=240, help="inner steps per unit")
    out.add_argument("--h-steps", type=int, default=30)
    out.add_argument("--seed", type=int, default=1, help="seeds the data and the failures")
    seeds = lambda text: [int(seed) for seed in text.split(",") if seed]  # noqa: E731
    out.add_argument("--seeds", type=seeds, default=[2, 3], help="more seeds without failures")
    out.add_argument("--rates", default="30", help="MTBF seconds per unit, comma-separated")
    out.add_argument("--mttr-s", type=float, default=10.0)
    out.add_argument("--kinds", default="kill,pause,cut")
    out.add_argument("--sync-timeout-s", type=float, default=10.0)
    out.add_argument(
        "--extra-seeds", type=seeds, default=[2], help="seeds of the highest rate again"
    )
    out.add_argument("--methods", default=",".join(METHODS), help="which methods to run")
    out.add_argument("--throttled", default="4mbit/25ms", help="every unit's link, each way")
    out.add_argument("--dp-max-s", type=float, default=2700.0, help="the PS's limit on the link")
    out.add_argument("--reuse", action="store_true", help="keep the runs already stored")
    out.add_argument("--render", action="store_true", help="run nothing: render the stored")
    out.add_argument("--write", action="store_true", help="update BENCHMARKS.md + plot")
    out.add_argument("--quick", action="store_true", help="smoke version: tiny model, few rows")
    return out


QUICK = dict(
    model="tiny", learners=2, steps=40, h_steps=10, seeds=[], rates="20", mttr_s=3.0,
    extra_seeds=[], throttled="50mbit/10ms", dp_max_s=120.0,
)  # fmt: skip


def main() -> None:
    args = parser().parse_args()
    if args.quick:
        vars(args).update(QUICK)
    path = results_path(NAME, args.quick)
    results = load(path) if args.reuse or args.render else GoodputResults()
    if not args.render:
        started = time.monotonic()
        provenance = Provenance.start(PROGRAM, {k: v for k, v in vars(args).items()}, path)
        results.provenance.append(provenance)
        cache = Path(tempfile.mkdtemp(prefix="goodput-jax-cache-"))
        code = commit(path)
        planned = rows(args)
        assert planned[0].method == "decoupled", "the target comes from a decoupled run"
        for index, row in enumerate(planned):
            if row.key in results.runs:
                continue
            t0 = time.time()
            fig = figures(row, run(row, args, results.target, cache), args, code)
            results.runs[row.key] = fig
            if index == 0 and results.target is None:
                pending = [r.key for r in planned[1:] if r.key not in results.runs]
                results.target = define_target(fig, pending)
                note(f"target: {results.target.nats_per_byte} ({results.target.source})")
            note(
                f"{row.key:45s} goodput {_f(fig.goodput, '.3f')} up {_f(fig.up, '.3f')} "
                f"final {_f(fig.final_eval, '.4f')} at {fig.end_s:.0f}s ({time.time() - t0:.0f}s)"
            )
            provenance.seconds = round(time.monotonic() - started, 1)
            save(path, results)
    stored = Stored(results, args)
    checked = claims(stored)
    text = render(stored, results, checked, path)
    print(text)
    if args.write and not args.quick:
        plot(stored, PLOT)
        write_section(SECTION, text)
    exit_on(checked, args.quick)


if __name__ == "__main__":
    main()
