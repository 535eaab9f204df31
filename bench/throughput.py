"""Training throughput of a local cluster, and of one learner's loop by when it reads the loss.

* Cluster: runs ``diloco up`` (real nats-server, outer, gateway and learner processes) once per
  configuration with the same model and steps, reads the "training throughput" line of its
  summary (tokens/s summed over all units, from the first inner step to the last) and the
  final held-out loss.
* Standalone learner: drives the service's ``LearnerCore`` and ``BatchSampler`` in this process
  (no NATS) as the service's loop does: an inner step, then the uploads that are due. One row
  reads every step's loss on the host (``float(loss)``, which waits for the step before the next
  one is dispatched), the other leaves the losses on the device until uploads are taken. The
  two alternate in blocks of the same number of steps (in the order AB, BA, AB, ...), so that a
  change of the machine's load hits both alike; a row's figure is its best block (the one other
  work on the machine disturbed least), and the ratio is the median of the ratios of the blocks
  run next to each other.

Each prints a table of absolute figures and ratios to its first row; with ``--write``, the
tables and the exact command go into BENCHMARKS.md.

    .venv/bin/python bench/throughput.py --write
    .venv/bin/python bench/throughput.py --only standalone --write
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster import up_command  # bench/ is on sys.path when run as a script
from report import shown_command, write_section

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIGS = [
    ("1 learner, 2 XLA threads", ["--learners", "1", "--learner-threads", "2"]),
    ("4 learners, 1 XLA thread each", ["--learners", "4", "--learner-threads", "1"]),
    ("4 learners, 2 XLA threads each", ["--learners", "4", "--learner-threads", "2"]),
]
SECTION = "## Cluster training throughput"
STANDALONE_SECTION = "## Standalone learner: reading the loss every step or at boundaries"
STANDALONE_ROWS = [
    ("loss read every step", True),
    ("loss read at upload boundaries", False),
]


def run_config(extra: list[str], common: list[str], cache: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "DILOCO_JAX_CACHE": str(cache)}
        result = subprocess.run(
            up_command(data_dir, *common, *extra),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    out = result.stdout
    if result.returncode != 0:
        raise SystemExit(f"diloco up failed ({result.returncode}):\n{out}\n{result.stderr}")
    rate = re.search(r"training throughput ([\d,]+) tokens/s", out)
    loss = re.search(r"-> ([\d.]+) nats/byte", out)
    if not rate or not loss:
        raise SystemExit(f"no summary in the output:\n{out}")
    return {"tokens_per_s": float(rate.group(1).replace(",", "")), "eval": float(loss.group(1))}


def standalone_rates(args: argparse.Namespace) -> dict[bool, list[float]]:
    """Tokens/s of each block of ``--block-steps`` steps, by whether the loss was read every
    step; the two kinds of block alternate (AB, BA, ...), after one warm-up block."""
    import jax

    from services.learner.service import build_core
    from services.learner.settings import LearnerSettings
    from shared.runtime import configure_jax

    configure_jax()
    total = (2 * args.repeats + 1) * args.block_steps
    settings = LearnerSettings(
        job="bench",
        model=args.model,
        unit=0,
        num_units=1,
        h_steps=args.h_steps,
        max_steps=total,
        dynamic_h=False,
    )
    core, sampler, _ = build_core(settings)
    core.trainer.step(core.state, sampler.batch(0))[1].block_until_ready()  # compile

    def block(read_every_step: bool) -> float:
        started = time.perf_counter()
        for _ in range(args.block_steps):
            loss = core.train_step(sampler.batch(core.step))
            if read_every_step:
                float(loss)
            core.due_uploads()
        jax.block_until_ready(core.state)
        return args.block_steps * core.tokens_per_step / (time.perf_counter() - started)

    block(False)  # warm-up: the uploads' first host copies
    rates: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(args.repeats):
        order = STANDALONE_ROWS if repeat % 2 == 0 else STANDALONE_ROWS[::-1]
        for name, read_every_step in order:
            rates[read_every_step].append(block(read_every_step))
            print(f"{name:32s} {rates[read_every_step][-1]:10,.0f} tokens/s", flush=True)
    return rates


def standalone_table(args: argparse.Namespace, command: str) -> str:
    rates = standalone_rates(args)
    first = rates[STANDALONE_ROWS[0][1]]
    lines = [
        STANDALONE_SECTION,
        "",
        f"`{command}` — the learner service's core and sampler in one process (no NATS), model "
        f"`{args.model}`, batch 16, H={args.h_steps}, on this machine ({os.cpu_count()} cores). "
        f"Each row runs {args.repeats} blocks of {args.block_steps} inner steps (each step "
        "followed by the uploads that are due, as in the service's loop), alternating with the "
        "other row's (AB, BA, ...) after one warm-up block. Tokens/s is a row's best block (the "
        "one other work on the machine disturbed least); the ratio is the median, over the "
        "pairs of blocks run next to each other, of the row's block over the first row's.",
        "",
        "| learner loop | tokens/s (best block) | every block (tokens/s) | ratio |",
        "|---|---|---|---|",
    ]
    for name, mode in STANDALONE_ROWS:
        blocks = ", ".join(f"{rate:,.0f}" for rate in rates[mode])
        ratio = statistics.median(r / f for r, f in zip(rates[mode], first, strict=True))
        lines.append(f"| {name} | {max(rates[mode]):,.0f} | {blocks} | {ratio:.3f}× |")
    return "\n".join(lines) + "\n"


def cluster_table(args: argparse.Namespace, command: str) -> str:
    common = [
        "--model",
        args.model,
        "--max-steps",
        str(args.max_steps),
        "--h-steps",
        str(args.h_steps),
    ]
    cache = Path(tempfile.mkdtemp(prefix="diloco-bench-jax-"))
    rows = []
    for name, extra in CONFIGS:
        figures = run_config(extra, common, cache)
        rows.append((name, figures))
        print(
            f"{name:34s} {figures['tokens_per_s']:10,.0f} tokens/s  eval {figures['eval']:.3f}",
            flush=True,
        )
    base = rows[0][1]["tokens_per_s"]
    lines = [
        SECTION,
        "",
        f"`{command}` — `diloco up` with model `{args.model}`, "
        f"{args.max_steps} inner steps per unit, H={args.h_steps}, on this machine "
        f"({os.cpu_count()} cores). Tokens/s are summed over all units from the first inner "
        "step to the last; the ratio is to the first row, measured in the same run. The eval "
        "column is not a quality comparison: a single learner trains on a quarter of the tokens.",
        "",
        "| configuration | tokens/s | ratio | final eval (nats/byte) |",
        "|---|---|---|---|",
    ]
    for name, figures in rows:
        lines.append(
            f"| {name} | {figures['tokens_per_s']:,.0f} | {figures['tokens_per_s'] / base:.2f}× "
            f"| {figures['eval']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--max-steps", type=int, default=120, help="cluster: steps per unit")
    parser.add_argument("--h-steps", type=int, default=30)
    parser.add_argument(
        "--only", choices=["cluster", "standalone"], help="run one of the two tables only"
    )
    parser.add_argument(
        "--block-steps", type=int, default=30, help="standalone: inner steps per block"
    )
    parser.add_argument("--repeats", type=int, default=8, help="standalone: blocks per row")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    command = shown_command("python bench/throughput.py")
    tables = []
    if args.only != "standalone":
        tables.append((SECTION, cluster_table(args, command)))
    if args.only != "cluster":
        tables.append((STANDALONE_SECTION, standalone_table(args, command)))
    for section, table in tables:
        print("\n" + table)
        if args.write:
            write_section(section, table)


if __name__ == "__main__":
    main()
