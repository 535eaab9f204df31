"""Load test of the outer and the broker: ``diloco loadtest`` with 4, 8, 16, 32 and 64 synthetic
units of the ``medium`` model, each uploading every 10 s through its own shaped link and
fetching the params it would adopt; the stages' table and the saturation point go into the
"Load test" section of BENCHMARKS.md.

    .venv/bin/python bench/loadtest.py --write
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import shown_command, write_section  # bench/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.loadtest.records import LoadtestReport
from services.loadtest.report import table, verdict
from shared import records

SECTION = "## Load test"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--units", default="4,8,16,32,64")
    parser.add_argument("--upload-every-s", default="10")
    parser.add_argument("--link", default="100mbit/25ms")
    parser.add_argument("--warmup-s", default="30")
    parser.add_argument("--stage-s", default="60")
    parser.add_argument("--params-fetch", default="newest")
    parser.add_argument("--write", action="store_true", help="write BENCHMARKS.md")
    args = parser.parse_args()
    command = shown_command(".venv/bin/python bench/loadtest.py")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="loadtest-") as data_dir:
        flags = [
            *("--model", args.model, "--units", args.units),
            *("--upload-every-s", args.upload_every_s, "--link", args.link),
            *("--warmup-s", args.warmup_s, "--stage-s", args.stage_s),
            *("--params-fetch", args.params_fetch, "--data-dir", data_dir),
        ]
        subprocess.run(
            [sys.executable, "-m", "services.cli", "loadtest", *flags],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=True,
        )
        report = records.decode(LoadtestReport, Path(data_dir, "loadtest.json").read_bytes())
    assert report is not None, "the load test wrote no report"
    minutes = (time.time() - started) / 60
    lines = [
        SECTION,
        "",
        f"`{command}` — `diloco loadtest`: for each number of units, a fresh nats-server and "
        f"`diloco outer` (model `{report.model}`, {report.param_count:,} parameters, params "
        f"codec {report.params_codec}, evaluations off) take uploads from that many synthetic "
        f"units (no JAX). Each unit uploads a {report.codec} pseudo-gradient "
        f"({report.upload_payload_bytes / 1e6:.2f} MB, Laplace noise with the RMS and the "
        "compressed size of a real one: `services/loadtest/payloads.py`) every "
        f"{report.upload_every_s:g} s from a random phase, through its own "
        f"{report.link.text()} link, and fetches params as a learner does "
        f"(`{report.params_fetch}`). Rates are over the measurement window after a warm-up; "
        "sync latency is an upload's time from its sync point to the first params head that "
        "includes it; backlog is uploads published and not yet applied; CPU is cores used by "
        "the outer, nats-server and the load generator (its units and their links); drain is "
        "the time the outer took to apply the rest after the last upload; books: every "
        "published upload applied "
        f"exactly once. Whole run: {minutes:.1f} min on {os.cpu_count()} cores, everything on "
        "this one machine.",
        "",
        *table(report),
        "",
        f"**{verdict(report)}**",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
