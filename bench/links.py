"""Training over throttled links: ``diloco up`` with every learner behind a shaped link.

One ``diloco up`` run per row and seed, each on the shipped defaults (model ``small``, H = 30,
the default algorithm and codecs) but for what the row names:

* the grid: 4 units, every unit's link without a cap (the same link processes, nothing
  throttled), then 100, 20, 5 and 1 Mbit/s and 500 kbit/s, 50 ms one-way delay, with int8 and
  with int4 uploads (params coming down as int4 and int2 deltas: the default follows the
  upload codec);
* the reference: 4 units without a cap, fp32 copies of every version sent down;
* 2 units without a cap, at 1 Mbit/s and at 500 kbit/s (the case that diverged before the
  outer's momentum followed staleness: docs/ALGORITHMS.md, "Staleness");
* the moonshot: 4 units without a cap, H = 100, the smallest codec both ways; over 900 steps
  (nine syncs at H = 100), beside the default at the same 900 steps, with at most one or two
  fetches of each fragment per period and the outer learning rates and momentum ages of
  ``MOONSHOT_VARIANTS`` (as claimed: two fetches, outer lr 1.0);
* each of these with one fragment (``--fragments 1``, the default until five fragments with
  ``--stagger auto`` replaced it), and 4 units with five fragments staggered from the start
  (``--stagger always``) at no cap, 1 Mbit/s and 500 kbit/s;
* 4 units with int4 uploads and int4 deltas down (the downlink of int8 uploads; int4 uploads
  get int2 deltas) at every rate, and without a cap with at most two fetches per period;
* 4 units with int8 uploads and int2 deltas down at 500 kbit/s.

Every figure comes from the run's ``summary.json``: the final held-out loss; tokens/s of the
slowest unit (its tokens over the seconds it spent training) and its ratio to the no-cap run of
the same configuration; bytes up and down per token measured at the links, and how many times
fewer than data-parallel training of the same model, units and tokens (``shared.bandwidth``);
the busiest link direction's utilisation; the staleness of the applied updates; the seconds the
training loops spent in calls to the link.

The raw figures of every run go to ``bench/results/links.json`` (with the commit, the command
and the machine); ``--reuse`` keeps the runs stored there and runs only the missing ones, so the
grid can be filled over several invocations. The BENCHMARKS.md section is rendered from that
file (``--render`` renders it without running anything), with the issue's claims checked
(``claims``, ``evidence.Claim``): the script exits 1 when one fails or is not measured.

``--quick`` is the smoke version (``make bench-quick``): the same code on the model ``tiny``,
``QUICK_STEPS`` inner steps, one seed and only the rows ``QUICK_LABELS``, its runs stored under
``evidence.quick_dir()`` and BENCHMARKS.md left alone. It checks only the claims about the rows
it ran (claims are made from the rows of the run's table: the full table has every row, so a
full run needs them all), and fails only when one of those is not measured.

    .venv/bin/python bench/links.py --write
    .venv/bin/python bench/links.py --render --seeds 2   # the section from the stored runs
    .venv/bin/python bench/links.py --quick              # the smoke version
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster import up_command  # bench/ is on sys.path when run as a script
from evidence import (
    Claim,
    at_least,
    exit_on,
    note,
    ratio_at_most,
    render_claims,
    results_path,
    save,
)
from pydantic import BaseModel
from report import BENCHMARKS, commit, shown_command, write_section

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.orchestration.local.records import RunSummary
from shared.bandwidth import unit_data_parallel_bytes_per_token
from shared.records.unit import UnitStatus

SECTION = "## Throttled links"
NAME = "links"
RESULTS = results_path(NAME, quick=False)
PLOT = REPO / "bench" / "links.png"
DELAY = "50ms"
RATES = ["no cap", "100mbit", "20mbit", "5mbit", "1mbit", "500kbit"]
SLOW_RATES = ["1mbit", "500kbit"]
CODECS = ["int8", "int4"]
UNITS = 4
FEW_UNITS = 2
MODEL = "small"
STEPS = 300  # inner steps per unit (``--steps``)
SEEDS = 2  # (``--seeds``)
#: The quick run: the same code on a small model, few steps, one seed and two of the rows, a
#: no-cap row and its 1 Mbit/s twin (the claims it makes: the slow link's final eval, and every
#: run's time in network calls). Its 4-unit twins would add the bytes and speed claims, but take
#: about 1.6 times as long (~100 CPU-s against ~65).
QUICK_MODEL = "tiny"
QUICK_STEPS = 60
QUICK_SEEDS = 1
QUICK_LABELS = (f"{FEW_UNITS} units, no cap, int8", f"{FEW_UNITS} units, 1mbit, int8")
#: Flags of the rows that are not on the grid (each on top of the shipped defaults).
REFERENCE_FLAGS = (
    "--params-downlink",
    "copy",
    "--params-codec",
    "fp32",
    "--params-fetch",
    "newest",
)
MOONSHOT_FLAGS = ("--h-steps", "100", "--params-downlink", "delta", "--params-delta-codec", "int2")
#: The moonshot over a budget long enough for H = 100 to sync nine times, compared with the
#: default at the same budget: what each row adds to MOONSHOT_FLAGS (docs/ALGORITHMS.md,
#: "Staleness", for what each did). The first is the one claimed: two fetches of each fragment
#: per period, and an outer learning rate that makes up for the momentum staler merges lose.
MOONSHOT_STEPS = 900
MOONSHOT_VARIANTS = (
    (
        "2 fetches per period, outer lr 1.0",
        ("--params-fetches-per-period", "2", "--outer-lr", "1.0"),
    ),
    ("2 fetches per period", ("--params-fetches-per-period", "2")),
    ("1 fetch per period, outer lr 1.0", ("--params-fetches-per-period", "1", "--outer-lr", "1.0")),
    ("1 fetch per period", ("--params-fetches-per-period", "1")),
    (
        "1 fetch per period, outer lr 1.0, momentum age 2",
        ("--params-fetches-per-period", "1", "--outer-lr", "1.0", "--momentum-max-age", "2"),
    ),
)
CLAIMED_MOONSHOT_FLAGS = (*MOONSHOT_FLAGS, *MOONSHOT_VARIANTS[0][1])
#: The default before it became five fragments staggered when the link is slow: every default
#: row's twin, labelled ", 1 fragment".
ONE_FRAGMENT_FLAGS = ("--fragments", "1")
#: Five fragments staggered from the start, whatever the link (what ``--stagger auto`` does on
#: slow links only).
ALWAYS_STAGGERED_FLAGS = ("--fragments", "5", "--stagger", "always")
#: int4 uploads with the downlink that was the default for every codec: int4 deltas of every
#: version (now int2 deltas follow int4 uploads: ``shared.settings.codec.narrower_delta_codec``).
INT4_DELTAS_FLAGS = ("--params-delta-codec", "int4")
#: ... and with at most two fetches of each fragment per period instead of every version.
PACED_FETCH_FLAGS = (*INT4_DELTAS_FLAGS, "--params-fetches-per-period", "2")
#: int8 uploads with int2 deltas down (what int4 uploads get by default), at 500 kbit/s.
INT2_DELTAS_FLAGS = ("--params-delta-codec", "int2")

#: The claims (issue "Over slow links", "Done when").
MAX_SLOW_LOSS_RATIO = 1.03  # final eval at 1 Mbit/s and 500 kbit/s over the no-cap row's
MIN_TIMES_LESS = {"int8": 100.0, "int4": 200.0}  # bytes both ways against data-parallel
MAX_REFERENCE_LOSS_RATIO = 1.01  # a no-cap row's final eval over fp32 copies of every version
MIN_MOONSHOT_TIMES_LESS = 1000.0
MAX_MOONSHOT_LOSS_RATIO = 1.02  # over the default (4 units, no cap, int8) at its budget
MIN_SPEED_RATIO = 0.9  # slowest unit's tokens/s at 1 Mbit/s over the no-cap row's
MAX_NETWORK_WAIT_SHARE = 0.01  # of a unit's training time, in calls to the link


@dataclass(frozen=True)
class Row:
    """One configuration of the table: units, every unit's link rate, the upload codec and
    any other flags (on top of the shipped defaults)."""

    label: str
    units: int
    rate: str
    codec: str
    flags: tuple[str, ...] = ()
    steps: int | None = None  # inner steps per unit (None: ``--steps``)

    @property
    def link(self) -> str:
        rate = "unlimited" if self.rate == "no cap" else self.rate
        return f"{rate}/{DELAY}"

    def key(self, seed: int) -> str:
        return f"{self.label} / seed {seed}"


def rows() -> list[Row]:
    """The grid, the reference, the 2-unit rows and the moonshot on the defaults; then each
    one's twin with one fragment, and five fragments always staggered, in table order."""
    grid = [
        Row(f"{UNITS} units, {rate}, {codec}", UNITS, rate, codec)
        for codec in CODECS
        for rate in RATES
    ]
    few = [
        Row(f"{FEW_UNITS} units, {rate}, int8", FEW_UNITS, rate, "int8")
        for rate in ["no cap", *SLOW_RATES]
    ]
    defaults = [
        *grid,
        Row(
            f"{UNITS} units, no cap, fp32 copies of every version (int8 uploads)",
            UNITS,
            "no cap",
            "int8",
            REFERENCE_FLAGS,
        ),
        *few,
        Row(
            f"{UNITS} units, no cap, moonshot (H=100, int2)",
            UNITS,
            "no cap",
            "int2",
            MOONSHOT_FLAGS,
        ),
    ]
    return [
        *defaults,
        *(
            Row(f"{UNITS} units, no cap, moonshot (H=100, int2, {what}), {MOONSHOT_STEPS} steps",
                UNITS, "no cap", "int2", (*MOONSHOT_FLAGS, *flags), MOONSHOT_STEPS)
            for what, flags in MOONSHOT_VARIANTS
        ),
        Row(f"{UNITS} units, no cap, int8, {MOONSHOT_STEPS} steps", UNITS, "no cap", "int8",
            steps=MOONSHOT_STEPS),
        *(
            Row(f"{row.label}, 1 fragment", row.units, row.rate, row.codec,
                row.flags + ONE_FRAGMENT_FLAGS)
            for row in defaults
        ),
        *(
            Row(f"{UNITS} units, {rate}, int8, 5 fragments always staggered", UNITS, rate,
                "int8", ALWAYS_STAGGERED_FLAGS)
            for rate in ["no cap", *SLOW_RATES]
        ),
        *(
            Row(f"{UNITS} units, {rate}, int4, int4 deltas down", UNITS, rate, "int4",
                INT4_DELTAS_FLAGS)
            for rate in RATES
        ),
        Row(f"{UNITS} units, no cap, int4, int4 deltas down, at most 2 fetches per period",
            UNITS, "no cap", "int4", PACED_FETCH_FLAGS),
        Row(f"{UNITS} units, 500kbit, int8, int2 deltas down", UNITS, "500kbit", "int8",
            INT2_DELTAS_FLAGS),
    ]  # fmt: skip


def quick_rows() -> list[Row]:
    """The rows of the quick run (``QUICK_LABELS``), as the full run has them."""
    return [row for row in rows() if row.label in QUICK_LABELS]


class RunFigures(BaseModel):
    """What one run measured (the worst unit where units differ)."""

    label: str
    seed: int
    commit: str
    command: list[str]
    elapsed_s: float
    final_eval: float | None
    init_eval: float | None
    tokens: int
    tokens_per_s: float
    up_per_token: float
    down_per_token: float
    times_less: float | None
    utilisation: float | None
    staleness: dict[int, int]
    network_wait_share: float
    staggered: int | None = None  # units whose fragments ended staggered (None: not recorded)
    # Per unit, bytes/s of its link beyond the uploads and params it counted itself (heartbeats,
    # record reads, notifications, framing), up and down; None: runs from before it was kept.
    control_up_per_s: float | None = None
    control_down_per_s: float | None = None


class Results(BaseModel):
    """``bench/results/links.json``: every run, keyed by row and seed."""

    machine: str
    invocations: list[str] = []  # the commands that made the runs
    runs: dict[str, RunFigures] = {}


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"


def command_of(row: Row, args: argparse.Namespace, seed: int, data_dir: str) -> list[str]:
    flags = [
        *("--model", args.model, "--learners", str(row.units)),
        *("--max-steps", str(row.steps or args.steps)),
        *("--seed", str(seed), "--codec", row.codec, "--link", row.link),
        *row.flags,
    ]
    return up_command(data_dir, *flags)


def run(row: Row, args: argparse.Namespace, seed: int, cache: Path) -> RunFigures:
    """One ``diloco up`` run and its figures."""
    started = time.time()
    with tempfile.TemporaryDirectory() as data_dir:
        command = command_of(row, args, seed, data_dir)
        env = {**os.environ, "DILOCO_JAX_CACHE": str(cache)}
        result = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600
        )
        if result.returncode != 0:
            raise SystemExit(f"diloco up failed:\n{result.stdout}\n{result.stderr}")
        summary = RunSummary.model_validate_json(Path(data_dir, "summary.json").read_text())
    if not summary.ledger.balanced:
        raise SystemExit(f"{row.label}: the books do not balance: {summary.ledger}")
    shown = [part if part != data_dir else "<data-dir>" for part in command[2:]]
    return figures(row, seed, summary, shown, time.time() - started)


def speed(status: UnitStatus) -> float:
    """A unit's training speed over the whole run: its tokens per second spent training."""
    return status.tokens / status.training_s if status.training_s > 0 else 0.0


def figures(
    row: Row, seed: int, summary: RunSummary, command: list[str], elapsed_s: float
) -> RunFigures:
    units = summary.units
    slowest = min(units.values(), key=speed)
    tokens = sum(status.tokens for status in units.values())
    up = sum(summary.links[str(unit)].bytes_up for unit in units)
    down = sum(summary.links[str(unit)].bytes_down for unit in units)
    data_parallel = unit_data_parallel_bytes_per_token(slowest)
    utilisation = [max(busy) for link in summary.links.values() if (busy := link.utilisation())]
    control = [
        (
            (summary.links[str(unit)].bytes_up - status.counters.get("bytes_sent", 0))
            / status.training_s,
            (summary.links[str(unit)].bytes_down - status.counters.get("params_bytes_received", 0))
            / status.training_s,
        )
        for unit, status in units.items()
        if status.training_s > 0
    ]
    outer = summary.outer
    init = outer.evaluation.init if outer is not None else None
    last = outer.evaluation.last if outer is not None else None
    return RunFigures(
        label=row.label,
        seed=seed,
        commit=commit(RESULTS, PLOT, BENCHMARKS),
        command=command,
        elapsed_s=round(elapsed_s, 1),
        final_eval=last.nats_per_byte if last is not None else None,
        init_eval=init.nats_per_byte if init is not None else None,
        tokens=tokens,
        tokens_per_s=speed(slowest),
        up_per_token=up / tokens,
        down_per_token=down / tokens,
        times_less=data_parallel / ((up + down) / tokens) if data_parallel else None,
        utilisation=max(utilisation) if utilisation else None,
        staleness=dict(outer.staleness) if outer is not None else {},
        staggered=sum(status.staggered for status in units.values()),
        control_up_per_s=statistics.fmean(c[0] for c in control) if control else None,
        control_down_per_s=statistics.fmean(c[1] for c in control) if control else None,
        network_wait_share=max(
            status.network_wait_s / status.training_s if status.training_s > 0 else 0.0
            for status in units.values()
        ),
    )


# ---- the table and the claims --------------------------------------------------------------


class Table:
    """The stored runs of each of a run's rows, and means over the seeds measured."""

    def __init__(self, results: Results, seeds: int, table_rows: list[Row]) -> None:
        self.runs = {
            row: [r for s in range(seeds) if (r := results.runs.get(row.key(s))) is not None]
            for row in table_rows
        }

    def find(
        self,
        units: int,
        rate: str,
        codec: str,
        flags: tuple[str, ...] = (),
        steps: int | None = None,
    ) -> Row | None:
        """The row of this configuration; None where the table does not have it."""
        wanted = (units, rate, codec, flags, steps)
        found = [r for r in self.runs if (r.units, r.rate, r.codec, r.flags, r.steps) == wanted]
        return found[0] if found else None

    def mean(self, row: Row, get: Callable[[RunFigures], float | None]) -> float | None:
        values = [v for run in self.runs[row] if (v := get(run)) is not None]
        return statistics.fmean(values) if values else None


def final(run: RunFigures) -> float | None:
    return run.final_eval


def slow_link_claim(table: Table, row: Row, base: Row) -> Claim:
    """``row``'s final eval is at most ``MAX_SLOW_LOSS_RATIO`` times its no-cap twin's."""
    return ratio_at_most(
        f"{row.label}: final eval ≤ {MAX_SLOW_LOSS_RATIO:g}× no cap",
        table.mean(row, final),
        table.mean(base, final),
        MAX_SLOW_LOSS_RATIO,
    )


def bytes_claim(table: Table, row: Row, bound: float) -> Claim:
    """``row`` sends at least ``bound`` times fewer bytes than data-parallel training."""
    claim = at_least(
        f"{row.label}: ≥ {bound:g}× fewer bytes than data-parallel",
        table.mean(row, lambda run: run.times_less),
        bound,
        ",.0f",
    )
    return claim if claim.holds is None else Claim(claim.text, f"{claim.measured}×", claim.holds)


def speed_claim(table: Table, row: Row, base: Row) -> Claim:
    """``row``'s slowest unit trains at least ``MIN_SPEED_RATIO`` times as fast as the no-cap
    twin's."""
    now = table.mean(row, lambda run: run.tokens_per_s)
    before = table.mean(base, lambda run: run.tokens_per_s)
    return at_least(
        f"{row.label}: tokens/s ≥ {MIN_SPEED_RATIO:g}× no cap",
        now / before if now is not None and before else None,
        MIN_SPEED_RATIO,
        ".2f",
    )


def claims(table: Table) -> list[Claim]:
    """The issue's "Done when" figures, checked against the stored runs: each claim whose rows
    the table has. A full run's table has every row, so each claim is made (and is "not
    measured" where its runs are missing); a quick run's has only its own rows, so it makes only
    the claims about them."""
    out: list[Claim] = []
    for units, codecs in ((UNITS, CODECS), (FEW_UNITS, ["int8"])):
        for codec in codecs:
            base = table.find(units, "no cap", codec)
            for rate in SLOW_RATES:
                row = table.find(units, rate, codec)
                if row is not None and base is not None:
                    out.append(slow_link_claim(table, row, base))
    reference = table.find(UNITS, "no cap", "int8", REFERENCE_FLAGS)
    for codec in CODECS:
        for rate in RATES:
            row = table.find(UNITS, rate, codec)
            if row is not None:
                out.append(bytes_claim(table, row, MIN_TIMES_LESS[codec]))
        row = table.find(UNITS, "no cap", codec)
        if row is not None and reference is not None:
            out.append(
                ratio_at_most(
                    f"{row.label}: final eval ≤ {MAX_REFERENCE_LOSS_RATIO:g}× fp32 copies of "
                    "every version",
                    table.mean(row, final),
                    table.mean(reference, final),
                    MAX_REFERENCE_LOSS_RATIO,
                )
            )
    moonshot = table.find(UNITS, "no cap", "int2", CLAIMED_MOONSHOT_FLAGS, MOONSHOT_STEPS)
    default = table.find(UNITS, "no cap", "int8", steps=MOONSHOT_STEPS)
    if moonshot is not None:
        out.append(bytes_claim(table, moonshot, MIN_MOONSHOT_TIMES_LESS))
    if moonshot is not None and default is not None:
        out.append(
            ratio_at_most(
                f"{moonshot.label}: final eval ≤ {MAX_MOONSHOT_LOSS_RATIO:g}× the default at the "
                "same budget",
                table.mean(moonshot, final),
                table.mean(default, final),
                MAX_MOONSHOT_LOSS_RATIO,
            )
        )
    for codec in CODECS:
        row, base = table.find(UNITS, "1mbit", codec), table.find(UNITS, "no cap", codec)
        if row is not None and base is not None:
            out.append(speed_claim(table, row, base))
    every = [run for runs in table.runs.values() for run in runs]
    waited = [
        f"{run.label} seed {run.seed}: {run.network_wait_share:.2%}"
        for run in every
        if run.network_wait_share > MAX_NETWORK_WAIT_SHARE
    ]
    out.append(
        Claim(
            f"every run: training loops ≤ {MAX_NETWORK_WAIT_SHARE:.0%} of their time in network "
            "calls",
            "; ".join(waited) or ("all within" if every else "not measured"),
            not waited if every else None,
        )
    )
    return out


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def shown(path: Path) -> Path:
    """``path`` relative to the repository where it is inside it."""
    return path.relative_to(REPO) if path.resolve().is_relative_to(REPO) else path


def render(
    table: Table,
    checked: list[Claim],
    results: Results,
    command: str,
    *,
    model: str = MODEL,
    steps: int = STEPS,
    path: Path = RESULTS,
    plotted: Path | None = None,
) -> str:
    """The section: the stored runs ``results`` (from ``path``) of ``table``'s rows, run on
    ``model`` for ``steps`` inner steps, the claims ``checked`` and the plot ``plotted``."""
    lines = [
        SECTION,
        "",
        f"`{command}` — `diloco up` runs, each at the commit in its row's last column, on the "
        f"shipped defaults (model `{model}`, H = 30, {steps} inner steps per unit) but for what "
        "each row names; every learner "
        f"reaches NATS through its own `diloco link` ({DELAY} one-way delay; 'no cap': the "
        "same links without a rate cap). Means over the seeds measured (the 'seeds' column); "
        "final held-out eval in nats/byte; tokens/s of the slowest unit; bytes per token "
        "measured at the links (all units' bytes over all units' tokens), and how many times "
        "fewer than data-parallel training of the same model, units and tokens (fp32 ring "
        "all-reduce every step); the busiest link direction's utilisation; the staleness of "
        "the applied updates; per seed, how many units ended with their fragments staggered "
        "('-': not recorded, runs from before `--stagger`); control traffic: a unit's link "
        "bytes/s beyond the uploads and params it counted itself (heartbeats, record reads, "
        "notifications, framing), up / down ('-': runs from before it was kept). Params come "
        "down as deltas one codec step narrower than the uploads, the default (int4 deltas "
        "with int8 uploads, int2 with int4). "
        "The rows ', 1 fragment' ran the default of their commit, one fragment; the rows "
        "', int4 deltas down' without that flag ran the default of their commit, int4 deltas "
        "for every codec. The moonshot rows with fewer than 2 seeds are probes of one seed. "
        "Raw figures of every run: "
        f"`{shown(path)}` "
        f"(machine: {results.machine}); the runs were made by "
        + ", ".join(f"`{c}`" for c in results.invocations)
        + ".",
        "",
        "| configuration | seeds | final eval | tokens/s | up B/token | down B/token "
        "| x less than data-parallel | utilisation | staleness (applied) | staggered units "
        "| control B/s per unit | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, runs in table.runs.items():
        if not runs:
            lines.append(f"| {row.label} | 0 | not measured | | | | | | | | | |")
            continue
        staleness: dict[int, int] = {}
        for run in runs:
            for value, count in run.staleness.items():
                staleness[value] = staleness.get(value, 0) + count
        commits = sorted({run.commit for run in runs})
        lines.append(
            f"| {row.label} | {len(runs)} | {_f(table.mean(row, lambda r: r.final_eval), '.4f')} "
            f"| {_f(table.mean(row, lambda r: r.tokens_per_s), ',.0f')} "
            f"| {_f(table.mean(row, lambda r: r.up_per_token), '.1f')} "
            f"| {_f(table.mean(row, lambda r: r.down_per_token), '.1f')} "
            f"| {_f(table.mean(row, lambda r: r.times_less), ',.0f')} "
            f"| {_f(table.mean(row, lambda r: r.utilisation), '.1%')} "
            f"| {dict(sorted(staleness.items()))} "
            f"| {'/'.join('-' if r.staggered is None else str(r.staggered) for r in runs)} "
            f"| {_f(table.mean(row, lambda r: r.control_up_per_s), ',.0f')} / "
            f"{_f(table.mean(row, lambda r: r.control_down_per_s), ',.0f')} "
            f"| {', '.join(commits)} |"
        )
    lines += ["", render_claims(checked).rstrip("\n")]
    if plotted is not None:
        lines += ["", f"![bytes per token and speed by link rate]({shown(plotted)})"]
    return "\n".join(lines) + "\n"


def plot(table: Table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for codec in CODECS:
        picked = [(rate, table.find(UNITS, rate, codec)) for rate in RATES]
        picked = [(rate, row) for rate, row in picked if row is not None and table.runs[row]]
        if not picked:
            continue
        labels = [rate for rate, _ in picked]
        left.plot(labels, [table.mean(r, lambda x: x.times_less) for _, r in picked], "o-",
                  label=codec)  # fmt: skip
        right.plot(labels, [table.mean(r, lambda x: x.final_eval) for _, r in picked], "o-",
                   label=codec)  # fmt: skip
    left.set_yscale("log")
    left.set_ylabel("x fewer bytes than data-parallel")
    left.legend()
    right.set_ylabel("final held-out eval (nats/byte)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, help=f"inner steps per unit ({STEPS}; quick: {QUICK_STEPS})"
    )
    parser.add_argument("--seeds", type=int, help=f"{SEEDS} (quick: {QUICK_SEEDS})")
    parser.add_argument(
        "--only", default="", help="run only rows whose label contains this (a|b: either)"
    )
    parser.add_argument("--reuse", action="store_true", help="keep the runs already stored")
    parser.add_argument("--render", action="store_true", help="run nothing: render the stored")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md + plot")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke version: {QUICK_MODEL}, {QUICK_STEPS} steps, 1 seed, rows "
        + "; ".join(QUICK_LABELS),
    )
    args = parser.parse_args()
    if args.quick and args.write:
        parser.error("--quick writes nothing here: leave out --write")
    args.model = QUICK_MODEL if args.quick else MODEL
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else STEPS
    if args.seeds is None:
        args.seeds = QUICK_SEEDS if args.quick else SEEDS
    path = results_path(NAME, args.quick)
    table_rows = quick_rows() if args.quick else rows()
    command = shown_command(".venv/bin/python bench/links.py")
    if args.render:
        if not path.exists():
            raise SystemExit(f"{path}: no stored results (run bench/links.py first)")
        results = Results.model_validate_json(path.read_text())
    else:
        results = Results(machine=machine())
        if args.reuse and path.exists():
            results = Results.model_validate_json(path.read_text())
        results.invocations.append(command)
        cache = Path(tempfile.mkdtemp(prefix="links-jax-cache-"))
        for row in table_rows:
            if not any(part in row.label for part in args.only.split("|")):
                continue
            for seed in range(args.seeds):
                if row.key(seed) in results.runs:
                    continue
                run_figures = run(row, args, seed, cache)
                results.runs[row.key(seed)] = run_figures
                note(f"{row.key(seed)}: {run_figures.model_dump_json()}")
                save(path, results)
    table = Table(results, args.seeds, table_rows)
    checked = claims(table)
    if args.write:
        plot(table, PLOT)
    plotted = PLOT if not args.quick and PLOT.exists() else None
    text = render(
        table, checked, results, command, model=args.model, steps=args.steps, path=path,
        plotted=plotted,
    )  # fmt: skip
    print(text)
    if args.write:
        write_section(SECTION, text)
    exit_on(checked, args.quick)


if __name__ == "__main__":
    main()
