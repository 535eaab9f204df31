"""Outer shards under load: ``diloco loadtest`` at the saturation point with the model in two
fragments, taken by one outer and by two outer shards (``--outer-shards 2``), on the same seeds;
the pairs' ingest, CPU and books go into the "Load test: outer shards" section of BENCHMARKS.md.

Each pair is two fresh ``diloco loadtest --units <units> --fragments 2`` runs on one seed, the
first with one outer, the second with two shards (each owning one fragment, with its own
consumer, lease, checkpoint and status). The claim: two shards apply ≥ 1.6× the uploads one
outer applies, or, where they do not, this machine's cores are what saturates (the outers,
nats-server and the load generator together use ≥ 90% of them): then the section states
what a shard costs (CPU-seconds per applied MB) instead.

Raw results: ``bench/results/outer_shards.json`` (every run's ``LoadtestReport``).

    .venv/bin/python bench/outer_shards.py --write            # 2 pairs at 64 units (~25 min)
    .venv/bin/python bench/outer_shards.py --render --write   # the section from the stored runs
    .venv/bin/python bench/outer_shards.py --quick            # the smoke version (tiny, 1 pair)
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

from evidence import Claim, Provenance, note, publish, render_claims, results_path, save
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.loadtest.records import LoadtestReport, LoadtestStage
from services.loadtest.run import REPORT_FILE
from shared import records

SECTION = "## Load test: outer shards"
NAME = "outer_shards"
PROGRAM = ".venv/bin/python bench/outer_shards.py"
FRAGMENTS = 2
SPEEDUP = 1.6  # the target: two shards ingest at least this many times one outer's
CORES_SHARE = 0.9  # the cores saturate when everything together uses this share of them
OVERHEAD = 1.25  # two shards' CPU-seconds per applied MB over one outer's, at most


class ShardsRun(BaseModel):
    """One ``diloco loadtest`` invocation: its shards, seed, exit code and report."""

    shards: int
    seed: int
    returncode: int
    report: LoadtestReport | None = None

    def stage(self) -> LoadtestStage | None:
        """Its one stage, if it finished."""
        if self.report is None or not self.report.stages:
            return None
        return self.report.stages[0]


class ShardsResults(BaseModel):
    """``bench/results/outer_shards.json``."""

    provenance: Provenance
    runs: list[ShardsRun] = []


@dataclass(frozen=True)
class Pair:
    """One outer and two shards on the same seed."""

    seed: int
    one: LoadtestStage
    two: LoadtestStage

    @property
    def speedup(self) -> float:
        """Uploads two shards applied per second over one outer's."""
        base = self.one.ingest_uploads_per_s
        return self.two.ingest_uploads_per_s / base if base else 0.0


def pairs(results: ShardsResults) -> list[Pair]:
    """Every seed measured with both one outer and two shards."""
    stages = {(run.seed, run.shards): run.stage() for run in results.runs}
    return [
        Pair(seed, one, two)
        for (seed, shards), one in stages.items()
        if shards == 1 and one is not None and (two := stages.get((seed, 2))) is not None
    ]


def cores_used(stage: LoadtestStage) -> float:
    """CPU cores the outers, nats-server and the load generator used together."""
    return stage.outer_cpu + stage.broker_cpu + stage.generator_cpu


def cpu_s_per_mb(stage: LoadtestStage) -> float | None:
    """The outers' CPU-seconds per payload MB (10^6 bytes) they applied."""
    return stage.outer_cpu / stage.ingest_mb_per_s if stage.ingest_mb_per_s else None


def claims(results: ShardsResults) -> list[Claim]:
    """What the section and docs/NETWORK.md claim, checked against the stored runs."""
    wanted = int(results.provenance.configuration.get("repeats", 1))
    cores = float(results.provenance.configuration.get("cores") or os.cpu_count() or 1)
    failed = [
        f"seed {r.seed}, {r.shards} shard(s): exit {r.returncode}"
        for r in results.runs
        if r.returncode
    ]
    found = pairs(results)
    out = [
        Claim(
            "every `diloco loadtest` run finished, one outer and two shards on each seed",
            "; ".join(failed) or f"{len(found)} of {wanted} pairs",
            not failed and len(found) >= wanted,
        )
    ]
    stages = [stage for p in found for stage in (p.one, p.two)]
    balanced = sum(s.books.balanced and s.books.published > 0 for s in stages)
    out.append(
        Claim(
            "the books balance in every run (each published upload applied exactly once, by "
            "the shard that owns its fragment)",
            f"{balanced} of {len(stages)} runs",
            balanced == len(stages) if stages else None,
        )
    )
    if not found:
        out.append(Claim(speedup_text(), "not measured", None))
        return out
    speedups = [p.speedup for p in found]
    busiest = [cores_used(p.two) / cores for p in found]
    sped_up = statistics.median(speedups) >= SPEEDUP
    cores_bound = min(busiest) >= CORES_SHARE
    out.append(
        Claim(
            speedup_text(),
            f"{', '.join(f'{s:.2f}' for s in speedups)}× (median "
            f"{statistics.median(speedups):.2f}×); two shards' runs used "
            f"{', '.join(f'{b:.0%}' for b in busiest)} of the {cores:g} cores",
            sped_up or cores_bound,
        )
    )
    costs = overheads(found)
    out.append(
        Claim(
            f"a shard costs little: two shards together spend ≤ {OVERHEAD:g}× one outer's "
            "CPU-seconds per applied MB (median of the pairs)",
            f"{', '.join(f'{c:.2f}' for c in costs)}× (median {statistics.median(costs):.2f}×)"
            if costs
            else "not measured",
            statistics.median(costs) <= OVERHEAD if costs else None,
        )
    )
    return out


def overheads(found: list[Pair]) -> list[float]:
    """Per pair, two shards' CPU-seconds per applied MB over one outer's."""
    out = []
    for pair in found:
        one, two = cpu_s_per_mb(pair.one), cpu_s_per_mb(pair.two)
        if one and two:
            out.append(two / one)
    return out


def speedup_text() -> str:
    return (
        f"two shards apply ≥ {SPEEDUP:g}× the uploads/s of one outer at the saturation point "
        f"(median of the pairs), or the machine's cores saturate (≥ {CORES_SHARE:.0%} used in "
        "every two-shard run) and the section states a shard's cost instead"
    )


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def pairs_table(found: list[Pair]) -> list[str]:
    lines = [
        "| seed | outer | offered uploads/s | applied uploads/s | applied MB/s | backlog start → "
        "end | CPU cores: outers / nats-server / generator (sum) | outers' CPU-s per applied "
        "MB | books |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in found:
        for name, s in (("one outer", p.one), ("two shards", p.two)):
            books = "balanced" if s.books.balanced else "NOT balanced"
            lines.append(
                f"| {p.seed} | {name} | {s.offered_uploads_per_s:.2f} "
                f"| {s.ingest_uploads_per_s:.2f} | {s.ingest_mb_per_s:.1f} "
                f"| {s.backlog_start} → {s.backlog_end} | {s.outer_cpu:.2f} / {s.broker_cpu:.2f} "
                f"/ {s.generator_cpu:.2f} ({cores_used(s):.2f}) | {_f(cpu_s_per_mb(s), '.4f')} "
                f"| {books} |"
            )
    return lines


def render(results: ShardsResults, checked: list[Claim], path: Path) -> str:
    """The section, from the stored results only."""
    p, c = results.provenance, results.provenance.configuration
    found = pairs(results)
    lines = [
        SECTION,
        "",
        p.line(path) + f" `diloco loadtest --units {c.get('units')} --fragments {FRAGMENTS}` "
        f"(model `{c.get('model')}`, each unit uploading its two fragments in turn, together "
        f"the model every {c.get('upload_every_s', 0):g} s, through its own "
        f"{c.get('link')} link), once with one outer and once with two outer shards "
        "(`--outer-shards 2`: each owns one fragment, with its own consumer, lease, checkpoint "
        'and status), on the same seed; the columns as in "Load test", CPU summed over the '
        f"shards; the machine has {c.get('cores')} cores.",
        "",
        *pairs_table(found),
        "",
    ]
    if found:
        speedups = [pair.speedup for pair in found]
        one_cost = [cpu_s_per_mb(pair.one) for pair in found]
        two_cost = [cpu_s_per_mb(pair.two) for pair in found]
        one_cores = [pair.one.outer_cpu for pair in found]
        two_cores = [pair.two.outer_cpu for pair in found]
        lines += [
            f"Two shards over one outer: {', '.join(f'{s:.2f}' for s in speedups)}× the applied "
            f"uploads/s. Everything runs on this machine's {c.get('cores')} cores, which "
            "every run kept busy: the two shards got "
            f"{', '.join(f'{x:.2f}' for x in two_cores)} cores where one outer got "
            f"{', '.join(f'{x:.2f}' for x in one_cores)}, and applied more by about that share. "
            "What a shard costs: the outers' CPU-seconds per applied MB, one outer "
            f"{', '.join(_f(x, '.4f') for x in one_cost)}, two shards (both together) "
            f"{', '.join(_f(x, '.4f') for x in two_cost)}: "
            f"{', '.join(f'{x:.2f}' for x in overheads(found))}× one outer's. This machine "
            "cannot show what shards on machines of their own apply: its cores are what "
            "saturates.",
            "",
        ]
    lines.append(render_claims(checked))
    return "\n".join(lines)


def invoke(args: argparse.Namespace, shards: int, seed: int, folder: Path, env: dict) -> ShardsRun:
    """One ``diloco loadtest`` run (its output on stderr) and what it wrote."""
    flags = [
        *("--model", args.model, "--units", str(args.units), "--seed", str(seed)),
        *("--upload-every-s", f"{args.upload_every_s:g}", "--link", args.link),
        *("--warmup-s", f"{args.warmup_s:g}", "--stage-s", f"{args.stage_s:g}"),
        *("--fragments", str(FRAGMENTS), "--outer-shards", str(shards)),
        *("--data-dir", str(folder)),
    ]
    note(f"diloco loadtest {' '.join(flags)}")
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "loadtest", *flags],
        cwd=REPO,
        env=env,
        stdout=sys.stderr,
    )
    written = folder / REPORT_FILE
    report = records.decode(LoadtestReport, written.read_bytes()) if written.exists() else None
    return ShardsRun(shards=shards, seed=seed, returncode=done.returncode, report=report)


def measure(args: argparse.Namespace, path: Path) -> ShardsResults:
    """The pairs, one seed after the other; saved after each run."""
    keys = ("model", "units", "upload_every_s", "link", "warmup_s", "stage_s", "seed", "repeats")
    configuration = {key: getattr(args, key) for key in keys}
    configuration["cores"] = os.cpu_count()
    results = ShardsResults(provenance=Provenance.start(PROGRAM, configuration, path))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="outer-shards-") as data_dir:
        cache = os.environ.get("DILOCO_JAX_CACHE") or str(Path(data_dir, "jax-cache"))
        env = {**os.environ, "PYTHONPATH": str(REPO), "DILOCO_JAX_CACHE": cache}
        for index in range(args.repeats):
            seed = args.seed + index
            for shards in (1, 2):
                folder = Path(data_dir, f"seed-{seed}-shards-{shards}")
                results.runs.append(invoke(args, shards, seed, folder, env))
                results.provenance.seconds = round(time.monotonic() - started, 1)
                save(path, results)
    return results


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out.add_argument("--model", default="medium")
    out.add_argument("--units", type=int, default=64, help="the saturation point's units")
    out.add_argument("--upload-every-s", type=float, default=10.0)
    out.add_argument("--link", default="100mbit/25ms")
    out.add_argument("--warmup-s", type=float, default=30.0)
    out.add_argument("--stage-s", type=float, default=60.0)
    out.add_argument("--seed", type=int, default=0, help="pair i runs seed + i")
    out.add_argument("--repeats", type=int, default=2, help="pairs (one outer, two shards)")
    out.add_argument("--render", action="store_true", help="run nothing: render the stored")
    out.add_argument("--write", action="store_true", help="write BENCHMARKS.md")
    out.add_argument("--quick", action="store_true", help="smoke version: tiny, one pair")
    return out


QUICK = dict(
    model="tiny", units=2, upload_every_s=1.0, link="20mbit/5ms", warmup_s=2.0, stage_s=4.0,
    repeats=1,
)  # fmt: skip


def main() -> None:
    args = parser().parse_args()
    if args.quick:
        vars(args).update(QUICK)
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    path = results_path(NAME, args.quick)
    if args.render:
        if not path.exists():
            raise SystemExit(f"{path}: no stored results (run bench/outer_shards.py first)")
        results = ShardsResults.model_validate_json(path.read_text())
    else:
        results = measure(args, path)
    checked = claims(results)
    publish(SECTION, render(results, checked, path), checked, args.write, args.quick)


if __name__ == "__main__":
    main()
