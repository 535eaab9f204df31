"""Training over throttled links: ``diloco up`` with every learner behind a shaped link.

One ``diloco up`` run per row, each with the same model, units and steps: links without a cap
(the baseline: the same link processes, nothing throttled), then 100, 20, 5 and 1 Mbit/s per
unit (and 500 kbit/s, where one upload takes most of the time between two) with 50 ms one-way
delay, each with int8 and int4 uploads, and one run in which one unit's
link is 10x slower than the others'. Every figure comes from the run's ``summary.json``:

* tokens/s: the slowest unit's training speed (its tokens over the seconds it spent training),
  and as a ratio to the baseline of the same codec in this run;
* bytes up and down per token, measured at each unit's link, and how many times fewer than
  data-parallel training of the same model, units and tokens (``shared.bandwidth``);
* link utilisation (busiest direction), upload and params latency percentiles (on the units'
  clocks), the time the training loops spent in network calls, and the final held-out loss;
* "upload / interval": one upload's median time (training loop to JetStream's acceptance) over
  the time between two uploads (H steps at the unit's speed). Where it is at least 0.5 the link
  is busy, and the unit's tokens/s must still be at least 0.9x the baseline.

The training loop never waits for the network (``tests/test_learner_checkpoint.py`` shows its
calls return while the link is stalled): the script exits 1 if, on any link, a unit's loop spent
more than 1% of its training time in calls to the link.

    .venv/bin/python bench/links.py --write
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
from shared.bandwidth import unit_data_parallel_bytes_per_token
from shared.records.unit import UnitStatus

SECTION = "## Throttled links"
PLOT = REPO / "bench" / "links.png"
DELAY = "50ms"
RATES = ["unlimited", "100mbit", "20mbit", "5mbit", "1mbit", "500kbit"]
CODECS = ["int8", "int4"]
MAX_NETWORK_WAIT_SHARE = 0.01  # of a unit's training time, in calls to the link


@dataclass
class Row:
    """One run: a label, the codec and each unit's link."""

    label: str
    codec: str
    links: list[str]


def rows(learners: int) -> list[Row]:
    """Every rate with every codec, then one unit on a 10x slower link (int8)."""
    table = [
        Row("no cap" if rate == "unlimited" else rate, codec, [f"{rate}/{DELAY}"] * learners)
        for codec in CODECS
        for rate in RATES
    ]
    slow = ["20mbit/50ms"] * (learners - 1) + ["2mbit/50ms"]
    table.append(Row("20mbit, one unit 2mbit", "int8", slow))
    return table


def run(row: Row, args: argparse.Namespace, cache: Path) -> RunSummary:
    """One ``diloco up`` run; its summary."""
    with tempfile.TemporaryDirectory() as data_dir:
        command = up_command(
            data_dir, *common_flags(args), "--codec", row.codec, "--links", ",".join(row.links)
        )
        env = {**os.environ, "DILOCO_JAX_CACHE": str(cache)}
        result = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600
        )
        if result.returncode != 0:
            raise SystemExit(f"diloco up failed:\n{result.stdout}\n{result.stderr}")
        summary = RunSummary.model_validate_json(Path(data_dir, "summary.json").read_text())
    if not summary.ledger.balanced:
        raise SystemExit(f"{row.label}: the books do not balance: {summary.ledger}")
    return summary


def common_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        args.model,
        "--learners",
        str(args.learners),
        "--max-steps",
        str(args.steps),
        "--h-steps",
        str(args.h_steps),
    ]


@dataclass
class Figures:
    """What one run measured (worst unit where units differ)."""

    tokens_per_s: float
    up_per_token: float
    down_per_token: float
    times_less: float | None
    utilisation: float | None
    upload_over_interval: float | None
    upload_p50: float | None
    upload_p95: float | None
    params_p50: float | None
    params_p95: float | None
    network_wait_s: float
    network_wait_share: float  # of its training time (worst unit)
    final_eval: float | None


def speed(status: UnitStatus) -> float:
    """A unit's training speed over the whole run: its tokens per second spent training."""
    return status.tokens / status.training_s if status.training_s > 0 else 0.0


def figures(summary: RunSummary, h_steps: int) -> Figures:
    units = summary.units
    slowest = min(units.values(), key=speed)
    tokens = sum(status.tokens for status in units.values())
    up = sum(summary.links[str(unit)].bytes_up for unit in units)
    down = sum(summary.links[str(unit)].bytes_down for unit in units)
    data_parallel = unit_data_parallel_bytes_per_token(slowest)
    utilisation = [max(busy) for link in summary.links.values() if (busy := link.utilisation())]
    ratios, up50, up95, par50, par95 = [], [], [], [], []
    for status in units.values():
        upload, params = status.upload_latency, status.params_latency
        if upload is not None:
            up50.append(upload.p50_s)
            up95.append(upload.p95_s)
            if speed(status) > 0:
                interval = h_steps * status.tokens_per_step / speed(status)
                ratios.append(upload.p50_s / interval)
        if params is not None:
            par50.append(params.p50_s)
            par95.append(params.p95_s)
    last = summary.outer.evaluation.last if summary.outer is not None else None
    return Figures(
        tokens_per_s=speed(slowest),
        up_per_token=up / tokens,
        down_per_token=down / tokens,
        times_less=data_parallel / ((up + down) / tokens) if data_parallel else None,
        utilisation=max(utilisation) if utilisation else None,
        upload_over_interval=max(ratios) if ratios else None,
        upload_p50=max(up50, default=None),
        upload_p95=max(up95, default=None),
        params_p50=max(par50, default=None),
        params_p95=max(par95, default=None),
        network_wait_s=max(status.network_wait_s for status in units.values()),
        network_wait_share=max(
            status.network_wait_s / status.training_s if status.training_s > 0 else 0.0
            for status in units.values()
        ),
        final_eval=last.nats_per_byte if last is not None else None,
    )


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(args, all_rows, results, elapsed_s, command) -> str:
    baseline = {row.codec: results[i] for i, row in enumerate(all_rows) if row.label == "no cap"}
    lines = [
        SECTION,
        "",
        f"`{command}` — `diloco up` with model `{args.model}`, {args.learners} learners, "
        f"{args.steps} inner steps each, H={args.h_steps}, the default algorithm; every learner "
        f"reaches NATS through its own `diloco link` ({DELAY} one-way delay; 'no cap': the same "
        "links without a rate cap, the baseline). Figures from each run's summary.json: "
        "tokens/s of the slowest unit and its ratio to the baseline of the same codec (same "
        "run of this script; a unit's speed is its tokens over the seconds it spent "
        "training); bytes per token measured at the links (all units' bytes over all "
        "units' tokens) and how many times fewer than data-parallel training of the same "
        "model, units and tokens (fp32 ring all-reduce every step); the busiest link "
        "direction's utilisation; one upload's median time over the time between two uploads "
        "(worst unit); upload (loop → JetStream) and params (head → loop) latency p50/p95 in "
        "seconds (worst unit); seconds the training loops spent in network calls (worst unit); "
        f"final held-out loss. Whole run: {elapsed_s / 60:.1f} min on {os.cpu_count()} cores.",
        "",
        "| links | codec | tokens/s (slowest unit) | vs no cap | up B/token | down B/token "
        "| x less than data-parallel | utilisation | upload / interval | upload p50/p95 s "
        "| params p50/p95 s | loop in network calls s | final eval |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, row in enumerate(all_rows):
        fig = results[index]
        base = baseline.get(row.codec)
        ratio = fig.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s else None
        lines.append(
            f"| {row.label} | {row.codec} | {fig.tokens_per_s:,.0f} | {_f(ratio, '.2f')} "
            f"| {fig.up_per_token:.1f} | {fig.down_per_token:.1f} | {_f(fig.times_less, ',.0f')} "
            f"| {_f(fig.utilisation, '.1%')} | {_f(fig.upload_over_interval, '.2f')} "
            f"| {_f(fig.upload_p50, '.2f')} / {_f(fig.upload_p95, '.2f')} "
            f"| {_f(fig.params_p50, '.2f')} / {_f(fig.params_p95, '.2f')} "
            f"| {fig.network_wait_s:.3f} | {_f(fig.final_eval, '.4f')} |"
        )
    lines += ["", f"![bytes per token and speed by link rate]({PLOT.relative_to(REPO)})", ""]
    return "\n".join(lines)


def plot(all_rows, results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for codec in CODECS:
        picked = [
            (row.label, results[i])
            for i, row in enumerate(all_rows)
            if row.codec == codec and row.label in ("no cap", *RATES)
        ]
        labels = [label for label, _ in picked]
        left.plot(labels, [f.up_per_token for _, f in picked], "o-", label=f"{codec} up")
        left.plot(labels, [f.down_per_token for _, f in picked], "s--", label=f"{codec} down")
        base = picked[0][1].tokens_per_s
        right.plot(labels, [f.tokens_per_s / base for _, f in picked], "o-", label=codec)
    left.set_ylabel("bytes per token at the link")
    left.set_title("bytes per token")
    left.legend()
    right.axhline(0.9, color="grey", linestyle=":")
    right.set_ylabel("slowest unit's tokens/s vs no cap")
    right.set_title("training speed")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150, help="inner steps per unit")
    parser.add_argument("--h-steps", type=int, default=30)
    parser.add_argument("--only", default="", help="run only rows whose label contains this")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md + plot")
    args = parser.parse_args()
    command = shown_command(".venv/bin/python bench/links.py")
    all_rows = [row for row in rows(args.learners) if args.only in row.label]
    cache = Path(tempfile.mkdtemp(prefix="links-jax-cache-"))
    started = time.time()
    results: dict[int, Figures] = {}
    for index, row in enumerate(all_rows):
        t0 = time.time()
        results[index] = figures(run(row, args, cache), args.h_steps)
        print(
            f"{row.label:24s} {row.codec}: {json.dumps(vars(results[index]), default=str)}"
            f" ({time.time() - t0:.0f}s)",
            flush=True,
        )
    text = table(args, all_rows, results, time.time() - started, command)
    print("\n" + text)
    if args.write:
        plot(all_rows, results, PLOT)
        write_section(SECTION, text)
    waited = [
        f"{row.label} {row.codec}: {results[i].network_wait_share:.2%}"
        for i, row in enumerate(all_rows)
        if results[i].network_wait_share > MAX_NETWORK_WAIT_SHARE
    ]
    if waited:
        raise SystemExit(f"training loops waited for the network: {'; '.join(waited)}")


if __name__ == "__main__":
    main()
