"""Robust merging on the real system: what peer review (on by default) costs honest runs,
and what one hostile unit of 4 (and two of 8) can do against it.

One ``diloco up`` run per row, all on the shipped defaults (model ``small``, 4 units, 240 inner
steps each) apart from what the row names:

* **clean**: the defaults, each of ``--seeds``; **clean, no review**: the same with
  ``--no-peer-review``. The honest cost is the mean over the seeds of clean / no review − 1.
  A real run's end depends on its timing (one configuration and seed has ended up to 2.4%
  apart from one run to the next on 2 cores), so the 0.5% bound is checked on the
  **simulator's twins** of the clean rows (``sim/training.py``: the same ``OuterCore`` and
  shipped defaults on a simulated clock, equal unit speeds; deterministic), with and without
  peer review, and the real runs are held to their noise (``REAL_NOISE``).
* **honest units alone**: ``--learners 3 --dn-period 4``, the reference for one hostile unit of
  4. A hostile unit's uploads are refused, so its work is lost to the job; what a defence can
  keep is the honest units' training in the job as configured (a job of 4 units merges under
  Delayed Nesterov with a momentum period of 4 arrivals, hence ``--dn-period 4``), and the
  attacked run is held to that. The clean run of 4 units is beside it.
* **attacks**: ``--adversaries 1 --adversary KIND`` for each attack of
  ``services/learner/adversary.py`` (unit 0 sends it with its own valid credentials from its
  first upload on), and the two the norm guard alone lets through at full size (``random``,
  ``scaled``) with ``--no-peer-review`` for contrast.
* **two of 8**: ``--learners 8 --adversaries 2 --adversary alie`` against ``--learners 6
  --dn-period 8``.

Every figure comes from the runs' ``summary.json``: the final held-out eval, the outer's
rejections and clips per unit, the books. Raw results: ``bench/results/robust.json``.

    .venv/bin/python bench/robust.py --write            # every row (about 45 min on 2 cores)
    .venv/bin/python bench/robust.py --render --write   # the section from the stored runs
    .venv/bin/python bench/robust.py --reuse --drop "no review" --write  # those rows again
    .venv/bin/python bench/robust.py --reuse --drop twin --write  # the simulator's twins again
    .venv/bin/python bench/robust.py --quick            # the smoke version (tiny model)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
from cluster import up_command  # bench/ is on sys.path when run as a script
from evidence import (
    Claim,
    Provenance,
    at_least,
    at_most,
    note,
    publish,
    ratio_at_most,
    render_claims,
    results_path,
    save,
)
from pydantic import BaseModel, Field

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.orchestration.local.records import RunSummary
from services.outer.peers import PACE_FACTOR, PACE_SLACK
from shared import data, evaluation, model
from shared.runtime import configure_jax
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.workload import WorkloadSettings
from sim import training as sim

SECTION = "## Robust merging: peer review against hostile units"
NAME = "robust"
PROGRAM = ".venv/bin/python bench/robust.py"
HONEST_COST = 1.005  # at most: twin / twin with --no-peer-review, mean over the seeds
# At most, on the real system: clean / clean with --no-peer-review, mean over the seeds. One
# configuration and seed ended up to 2.4% apart from one run to the next here (the same
# timing-dependent spread with or without review), and the mean of 3 seeds' ratios of two
# such runs spreads about as much: a cost beyond it is the review's.
REAL_NOISE = 1.025
ONE_OF_FOUR = 1.02  # at most: an attacked run / the honest units alone
TWO_OF_EIGHT = 1.05  # at most: two ALIE units of 8 / the 6 honest alone
CAUGHT = 0.9  # at least: share of the attacker's uploads refused (or clipped) for its reasons
ATTACKS = ["sign_flip", "random", "scaled", "alie", "replay", "too_frequent"]
#: What the outer counts an attack's uploads under: refusals for these reasons, or ``clipped``
#: (None: nothing it can tell; too_frequent's are all refused: see pace_ratio).
REASONS: dict[str, tuple[str, ...] | None] = {
    "sign_flip": ("direction_outlier",),
    "random": ("direction_outlier", "norm_outlier"),
    "scaled": ("clipped", "norm_outlier"),  # under the guard's 10x: clipped, or above it
    "alie": None,
    "replay": ("payload_replayed",),
    "too_frequent": None,
}
CONTRAST = ["random", "scaled"]  # attacks also run with --no-peer-review
FRAGMENTS = AlgorithmSettings().fragments  # the shipped default, which every row runs


class Row(BaseModel):
    """One run: its name, seed, units and the flags beyond the defaults."""

    name: str
    seed: int
    flags: list[str]
    learners: int = 4

    @property
    def key(self) -> str:
        return f"{self.name} / seed {self.seed}"


class RunFigures(BaseModel):
    """What one run measured."""

    key: str
    commit: str
    flags: list[str]
    elapsed_s: float
    final_eval: float
    balanced: bool
    applied: int
    hostile_units: list[int] = Field(description="the adversaries' unit numbers")
    hostile_published: int = Field(description="uploads the adversaries' status reports")
    hostile_rejected: dict[str, int] = Field(description="their uploads refused, by reason")
    hostile_clipped: int
    hostile_applied: int
    honest_rejected: dict[str, int]
    honest_clipped: int


class TwinCost(BaseModel):
    """The simulator's twins of one seed's clean rows, with and without peer review."""

    key: str
    commit: str
    with_review: float = Field(description="final eval with peer review (the default)")
    without_review: float = Field(description="final eval with --no-peer-review")
    rejected: dict[str, int] = Field(description="uploads peer review refused, by reason")
    seconds: float


class RobustResults(BaseModel):
    """Raw results of ``bench/robust.py``."""

    provenance: Provenance
    runs: dict[str, RunFigures] = {}
    twins: dict[str, TwinCost] = {}


def rows(args: argparse.Namespace) -> list[Row]:
    """Every run, in the order they run."""
    off = ["--no-peer-review"]
    out = [Row(name="clean", seed=s, flags=[]) for s in args.seeds]
    out += [Row(name="clean, no review", seed=s, flags=off) for s in args.seeds]
    first = args.seeds[0]
    alone = ["--dn-period", "4"]  # the momentum period of the job of 4 they are part of
    out.append(Row(name="honest units alone", seed=first, flags=alone, learners=3))
    for attack in args.attacks:
        hostile = ["--adversaries", "1", "--adversary", attack]
        out.append(Row(name=attack, seed=first, flags=hostile))
        if attack in CONTRAST:
            out.append(Row(name=f"{attack}, no review", seed=first, flags=[*off, *hostile]))
    if args.eight:
        two = ["--adversaries", "2", "--adversary", "alie"]
        six = ["--dn-period", "8"]
        out.append(Row(name="6 honest of 8 alone", seed=first, flags=six, learners=6))
        out.append(Row(name="2 alie of 8", seed=first, flags=two, learners=8))
    return out


def flags(row: Row, args: argparse.Namespace) -> list[str]:
    out = [
        *("--model", args.model, "--learners", str(row.learners)),
        *("--max-steps", str(args.steps), "--seed", str(row.seed)),
    ]
    if args.h_steps is not None:
        out += ["--h-steps", str(args.h_steps)]
    return [*out, *row.flags]


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
    if summary.reason != "finished":
        raise SystemExit(f"{row.key}: the run ended with {summary.reason!r}:\n{result.stdout}")
    return summary


def run_twins(seed: int, args: argparse.Namespace, code: str) -> TwinCost:
    """The simulator's twins of the clean rows of ``seed``: 4 units of equal speed from the
    seed's initial params, on the shipped defaults with and without peer review."""
    configure_jax()
    started = time.monotonic()
    cfg = model.get_config(args.model)
    corpus = data.split_corpus(data.load_corpus(None), 0.02)
    evaluate = evaluation.make_evaluator(cfg, data.eval_batches(corpus.heldout, cfg.seq_len, 16, 8))
    init = model.init_params(cfg, jax.random.PRNGKey(seed))
    workload = WorkloadSettings(model=args.model, max_steps=args.steps, seed=seed)
    h_steps = {} if args.h_steps is None else {"h_steps": args.h_steps}
    results = {}
    for review in (True, False):
        algorithm = AlgorithmSettings(**h_steps, peer_review=review)
        setup = sim.SimSetup(workload=workload, algorithm=algorithm, num_units=4)
        work = sim.Workload(setup, corpus, evaluate)
        results[review] = sim.async_run(work, init, [1.0] * setup.num_units, f"review {review}")
    return TwinCost(
        key=f"twin / seed {seed}",
        commit=code,
        with_review=round(results[True].final_eval, 5),
        without_review=round(results[False].final_eval, 5),
        rejected=results[True].rejected,
        seconds=round(time.monotonic() - started, 1),
    )


def twin_cost(results: RobustResults, seeds: list[int]) -> float | None:
    """Mean over the seeds of twin / twin without review (None: no seed's twins)."""
    twins = [results.twins.get(f"twin / seed {seed}") for seed in seeds]
    ratios = [t.with_review / t.without_review for t in twins if t is not None]
    return statistics.mean(ratios) if ratios else None


def hostile_units(row: Row) -> list[int]:
    if "--adversaries" not in row.flags:
        return []
    return list(range(int(row.flags[row.flags.index("--adversaries") + 1])))


def figures(row: Row, summary: RunSummary, code: str, args: argparse.Namespace) -> RunFigures:
    """The figures of one run, from its summary."""
    outer = summary.outer
    if outer is None or outer.evaluation.last is None:
        raise SystemExit(f"{row.key}: no outer status or evaluation in the summary")
    hostile = hostile_units(row)
    rejected: dict[bool, dict[str, int]] = {True: {}, False: {}}
    clipped = {True: 0, False: 0}
    applied = {True: 0, False: 0}
    for unit, stats in outer.units.items():
        bad = int(unit) in hostile
        for reason, count in stats.rejected.items():
            rejected[bad][reason] = rejected[bad].get(reason, 0) + count
        clipped[bad] += stats.clipped
        applied[bad] += stats.applied
    published = sum(
        books.published for unit, books in summary.ledger.per_unit.items() if int(unit) in hostile
    )
    return RunFigures(
        key=row.key,
        commit=code,
        flags=flags(row, args),
        elapsed_s=summary.elapsed_s,
        final_eval=outer.evaluation.last.nats_per_byte,
        balanced=summary.ledger.balanced,
        applied=outer.applied,
        hostile_units=hostile,
        hostile_published=published,
        hostile_rejected=rejected[True],
        hostile_clipped=clipped[True],
        hostile_applied=applied[True],
        honest_rejected=rejected[False],
        honest_clipped=clipped[False],
    )


def final(results: RobustResults, name: str, seed: int) -> float | None:
    found = results.runs.get(f"{name} / seed {seed}")
    return found.final_eval if found is not None else None


def honest_cost(results: RobustResults, seeds: list[int]) -> float | None:
    """Mean over the seeds of clean / clean, no review (None: no seed has both)."""
    ratios = []
    for seed in seeds:
        review, off = final(results, "clean", seed), final(results, "clean, no review", seed)
        if review and off:
            ratios.append(review / off)
    return statistics.mean(ratios) if ratios else None


def caught(fig: RunFigures, reasons: tuple[str, ...]) -> float | None:
    """The share of the attacker's hostile uploads the outer counted under ``reasons`` (a
    replaying unit's first upload of each fragment is an original, not a replay)."""
    hostile = fig.hostile_published - (FRAGMENTS if "payload_replayed" in reasons else 0)
    if hostile <= 0:
        return None
    count = sum(fig.hostile_rejected.get(reason, 0) for reason in reasons)
    count += fig.hostile_clipped if "clipped" in reasons else 0
    return count / hostile


def pace_ratio(fig: RunFigures, units: int = 4) -> float | None:
    """The attacker's applied uploads over what peer review's pace allows it: 2 x an honest
    unit's mean applied, + 2 per fragment (``services/outer/peers.py``)."""
    honest = units - len(fig.hostile_units)
    if not fig.hostile_units or honest <= 0:
        return None
    mean = (fig.applied - fig.hostile_applied) / honest
    allowed = PACE_FACTOR * mean + PACE_SLACK * FRAGMENTS
    return fig.hostile_applied / len(fig.hostile_units) / allowed


def claims(results: RobustResults, args: argparse.Namespace) -> list[Claim]:
    """The section's claims, for the rows this run has."""
    seeds, first = args.seeds, args.seeds[0]
    out = [
        at_most(
            f"peer review costs honest runs at most {HONEST_COST - 1:.1%} of final eval in the "
            f"simulator's twins (with / without, mean over {len(seeds)} seeds)",
            twin_cost(results, seeds),
            HONEST_COST,
            ".4f",
        ),
        at_most(
            f"on the real system, within its run-to-run spread: at most {REAL_NOISE - 1:.1%} "
            f"(clean / clean with --no-peer-review, mean over {len(seeds)} seeds)",
            honest_cost(results, seeds),
            REAL_NOISE,
            ".4f",
        ),
        at_least(
            "every run's books balance",
            float(all(f.balanced for f in results.runs.values())) if results.runs else None,
            1.0,
            ".0f",
        ),
    ]
    alone = final(results, "honest units alone", first)
    for attack in args.attacks:
        fig = results.runs.get(f"{attack} / seed {first}")
        value = fig.final_eval if fig is not None else None
        out.append(
            ratio_at_most(
                f"one {attack} unit of 4 ends within "
                f"+{ONE_OF_FOUR - 1:.0%} of the honest units alone",
                value,
                alone,
                ONE_OF_FOUR,
            )
        )
        if attack == "too_frequent":
            out.append(
                at_most(
                    "the too_frequent unit gets no more uploads applied than its pace allows "
                    f"({PACE_FACTOR:g} x an honest unit's + {PACE_SLACK} per fragment)",
                    pace_ratio(fig) if fig is not None else None,
                    1.0,
                )
            )
        reasons = REASONS[attack]
        if reasons is not None:
            out.append(
                at_least(
                    f"at least {CAUGHT:.0%} of the {attack} unit's uploads are counted as "
                    + " or ".join(reasons),
                    caught(fig, reasons) if fig is not None else None,
                    CAUGHT,
                )
            )
    if args.eight:
        out.append(
            ratio_at_most(
                f"two alie units of 8 end within +{TWO_OF_EIGHT - 1:.0%} "
                "of the 6 honest units alone",
                final(results, "2 alie of 8", first),
                final(results, "6 honest of 8 alone", first),
                TWO_OF_EIGHT,
            )
        )
    return out


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def render(
    results: RobustResults, checked: list[Claim], path: Path, args: argparse.Namespace
) -> str:
    """The BENCHMARKS.md section."""
    lines = [
        SECTION,
        "",
        results.provenance.line(path),
        "",
        "Final held-out eval (nats/byte) of `diloco up` runs on the shipped defaults (model "
        f"`{args.model}`, {args.steps} steps per unit) with what each row adds. The attacker "
        "is unit 0 (units 0 and 1 of 8), with its own credentials, from its first upload on "
        "(`--adversaries N --adversary KIND`, `services/learner/adversary.py`). Its uploads: "
        "what its status says it published, and how the outer counted them; the honest "
        "units' refusals and clips beside them. *÷ clean*: the final eval over the clean run "
        "of the same seed (all units honest: an attacked run has lost its attacker's work, "
        "so the claims hold it to its honest units alone).",
        "",
        "| run | final eval | ÷ clean | applied | attacker: published → refused (reason) | "
        "clipped | honest refused | honest clipped | minutes | commit |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|---|",
    ]
    for fig in results.runs.values():
        seed = int(fig.key.rsplit(" ", 1)[1])
        clean = final(results, "clean", seed)
        against = f"{fig.final_eval / clean:.3f}" if clean else "-"
        hostile = (
            f"{fig.hostile_published} → {_reasons(fig.hostile_rejected)}"
            if fig.hostile_units
            else "-"
        )
        lines.append(
            f"| {fig.key} | {fig.final_eval:.4f} | {against} | {fig.applied} | {hostile} | "
            f"{fig.hostile_clipped if fig.hostile_units else '-'} | "
            f"{_reasons(fig.honest_rejected)} | {fig.honest_clipped} | {fig.elapsed_s / 60:.1f} | "
            f"`{fig.commit}` |"
        )
    if results.twins:
        lines += [
            "",
            "The simulator's twins of the clean rows (`sim/training.py`: the same `OuterCore` "
            "and shipped defaults, 4 units of equal speed on a simulated clock, the seed's "
            "initial params and data order; deterministic), with and without peer review:",
            "",
            "| seed | with review | without | ratio | refused by review | minutes | commit |",
            "|---|---:|---:|---:|---|---:|---|",
        ]
        for twin in results.twins.values():
            lines.append(
                f"| {twin.key.rsplit(' ', 1)[1]} | {twin.with_review:.4f} | "
                f"{twin.without_review:.4f} | {twin.with_review / twin.without_review:.4f} | "
                f"{_reasons(twin.rejected)} | {twin.seconds / 60:.1f} | `{twin.commit}` |"
            )
    lines += ["", render_claims(checked)]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    seeds = lambda text: [int(seed) for seed in text.split(",") if seed]  # noqa: E731
    out.add_argument("--model", default="small")
    out.add_argument("--steps", type=int, default=240, help="inner steps per unit")
    out.add_argument("--h-steps", type=int, default=None, help="default: the shipped H")
    out.add_argument("--seeds", type=seeds, default=[1, 2, 3], help="seeds of the clean rows")
    out.add_argument("--attacks", default=",".join(ATTACKS), help="which attacks to run")
    out.add_argument("--no-eight", dest="eight", action="store_false", help="skip 2 of 8")
    out.add_argument("--reuse", action="store_true", help="keep the runs already stored")
    out.add_argument(
        "--drop",
        action="append",
        default=[],
        help="with --reuse: run again the stored rows whose name holds this text",
    )
    out.add_argument("--render", action="store_true", help="run nothing: render the stored")
    out.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    out.add_argument("--quick", action="store_true", help="smoke version: tiny model, few rows")
    return out


QUICK = dict(model="tiny", steps=40, h_steps=10, seeds=[1], attacks="sign_flip", eight=False)
CONFIGURATION = ("model", "steps", "h_steps", "seeds", "attacks", "eight")


def main() -> None:
    args = parser().parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    path = results_path(NAME, args.quick)
    if args.render or args.reuse:
        results = RobustResults.model_validate_json(path.read_text())
        # The stored runs' configuration, so that the claims are those of what ran.
        for key in CONFIGURATION:
            setattr(args, key, results.provenance.configuration[key])
        for stored in (results.runs, results.twins):
            for key in [k for k in stored if any(text in k for text in args.drop)]:
                del stored[key]
    else:
        configuration = {key: getattr(args, key) for key in CONFIGURATION}
        results = RobustResults(provenance=Provenance.start(PROGRAM, configuration))
    args.attacks = [a for a in args.attacks.split(",") if a]
    if not args.render:
        # The code these rows run (stored rows keep the commit they ran at).
        code = Provenance.start(PROGRAM, {}, path).commit
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as cache:
            for row in rows(args):
                if row.key in results.runs:
                    continue
                note(f"robust: {row.key} ...")
                summary = run(row, args, Path(cache))
                results.runs[row.key] = figures(row, summary, code, args)
                fig = results.runs[row.key]
                note(f"robust: {row.key}: final eval {fig.final_eval:.4f}")
                save(path, results)
        for seed in args.seeds:
            if f"twin / seed {seed}" in results.twins:
                continue
            note(f"robust: twins of seed {seed} ...")
            twin = run_twins(seed, args, code)
            results.twins[twin.key] = twin
            note(
                f"robust: twins of seed {seed}: {twin.with_review:.4f} with review, "
                f"{twin.without_review:.4f} without"
            )
            save(path, results)
        results.provenance.seconds += time.monotonic() - started
        save(path, results)
    checked = claims(results, args)
    publish(SECTION, render(results, checked, path, args), checked, args.write, args.quick)


if __name__ == "__main__":
    main()
