"""Training throughput of a whole local cluster, per configuration, measured in one run.

Runs ``diloco up`` (real nats-server, outer, gateway and learner processes) once per
configuration with the same model and steps, reads the "training throughput" line of its
summary (tokens/s summed over all units, from the first inner step to the last) and the final
held-out loss, and prints a table of absolute figures and ratios to the first row. With
``--write``, the table and the exact command go into BENCHMARKS.md.

    .venv/bin/python bench/throughput.py --write
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from report import write_section  # bench/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [
    ("1 learner, 2 XLA threads", ["--learners", "1", "--learner-threads", "2"]),
    ("4 learners, 1 XLA thread each", ["--learners", "4", "--learner-threads", "1"]),
    ("4 learners, 2 XLA threads each", ["--learners", "4", "--learner-threads", "2"]),
]
SECTION = "## Cluster training throughput"


def run_config(extra: list[str], common: list[str], cache: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "DILOCO_JAX_CACHE": str(cache)}
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "up",
                "--data-dir",
                data_dir,
                "--gateway-port",
                "0",
                *common,
                *extra,
            ],
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--h-steps", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
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
    command = "python bench/throughput.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:] if a != "--write"
    )
    lines = [
        SECTION,
        "",
        f"`{command.strip()}` — `diloco up` with model `{args.model}`, "
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
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    if args.write:
        write_section(SECTION, table)


if __name__ == "__main__":
    main()
