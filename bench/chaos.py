"""Chaos run: ``diloco up`` while random services are killed with ``kill -9``; books balance.

Starts a local cluster (``diloco up``, tiny model), and for ``--minutes`` kills a random live
service every few seconds — the outer, the gateway, nats-server or a learner, chosen and timed
by a seeded RNG — with SIGKILL, reading their PIDs from ``<data-dir>/pids.json``. ``diloco up``
restarts each one. After the chaos window the learners are stopped gracefully (SIGTERM: they
upload what they have and exit 0), the cluster finishes by itself, and its final summary
(``<data-dir>/summary.json``) is checked: every round any unit published was applied exactly
once or rejected with a reason (``shared.ledger.balance``). The ledger is printed, and with
``--write`` goes into BENCHMARKS.md.

    .venv/bin/python bench/chaos.py --minutes 5 --write

Exit status 0 only if the run finished and the books balanced.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from report import write_section

from services.orchestration.local import files
from services.orchestration.local.records import RunSummary
from shared.ledger import Books, RoundSet
from shared.records.outer import LedgerRecord

SECTION = "## Reliability: chaos run of `diloco up`"
DATA_DIR = REPO / "bench" / ".cache" / "chaos"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def start_up(args: argparse.Namespace) -> subprocess.Popen:
    if DATA_DIR.exists():
        shutil.rmtree(DATA_DIR)
    DATA_DIR.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--data-dir",
        str(DATA_DIR),
        "--model",
        "tiny",
        "--learners",
        str(args.learners),
        "--slowdowns",
        ",".join(["3"] * args.learners),
        "--max-steps",
        "1000000",  # they train until the chaos window is over and they are told to stop
        "--h-steps",
        "10",
        "--batch-size",
        "8",
        "--no-dynamic-h",
        "--gateway-port",
        "0",
        "--eval-every-s",
        "5",
        "--max-duration-s",
        str(args.minutes * 60 + 900),
    ]
    log("$ " + " ".join(command[2:]))
    out = open(DATA_DIR / "up.out", "wb")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ}
    )


class Kill(NamedTuple):
    """One SIGKILL of the chaos window."""

    t: float  # seconds into the window
    victim: str  # the child's name in pids.json


def pids() -> dict[str, int]:
    """The live children's PIDs by name (none while pids.json is missing or malformed)."""
    record = files.read_pids(DATA_DIR)
    return dict(record.pids) if record is not None else {}


def wait_for_training(up: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until a progress line shows an applied update (the units have started)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"diloco up exited early ({up.returncode}); see {DATA_DIR}/up.out")
        text = (DATA_DIR / "up.out").read_text(errors="replace")
        if re.search(r"\] v[1-9][0-9]* ", text):
            return
        time.sleep(1)
    raise SystemExit("training did not start")


def chaos(args: argparse.Namespace, up: subprocess.Popen) -> list[Kill]:
    rng = random.Random(args.seed)
    kills: list[Kill] = []
    started = time.monotonic()
    while time.monotonic() - started < args.minutes * 60:
        time.sleep(rng.uniform(args.min_gap_s, args.max_gap_s))
        if up.poll() is not None:
            raise SystemExit(f"diloco up exited during the chaos ({up.returncode})")
        live = pids()
        victims = sorted(name for name in live if name != "supervisor")
        if not victims:
            continue
        victim = rng.choice(victims)
        try:
            os.kill(live[victim], signal.SIGKILL)
        except ProcessLookupError:
            continue
        elapsed = time.monotonic() - started
        kills.append(Kill(round(elapsed, 1), victim))
        log(f"[{elapsed:6.1f}s] kill -9 {victim} (pid {live[victim]})")
    return kills


def stop_learners(up: subprocess.Popen, learners: int, timeout_s: float = 120) -> None:
    """SIGTERM every learner once all are up again (each uploads what it has and exits 0)."""
    stopped: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(stopped) < learners and time.monotonic() < deadline and up.poll() is None:
        for name, pid in pids().items():
            if name.startswith("learner-") and name not in stopped:
                try:
                    os.kill(pid, signal.SIGTERM)
                    stopped.add(name)
                except ProcessLookupError:
                    pass
        time.sleep(1)


def read_summary() -> RunSummary:
    """The run's ``summary.json``; a missing or malformed one reads as a run that did not end
    well, so that the table says so and the exit status is 1."""
    summary = files.read_summary(DATA_DIR)
    if summary is not None:
        return summary
    missing = f"no readable {DATA_DIR / files.SUMMARY_FILE}"
    return RunSummary(reason=missing, elapsed_s=0, ledger=Books(balanced=False, problems=[missing]))


def lost_rounds(summary: RunSummary) -> int:
    """Rounds a killed learner had numbered but not yet sent: lost with its memory, by design."""
    ledger = summary.outer if summary.outer is not None else LedgerRecord()
    lost = 0
    for unit, status in summary.units.items():
        life = collections.Counter(status.lifetime)
        known = RoundSet(status.published_rounds)
        for rounds in (ledger.applied_rounds, ledger.rejected_rounds):
            for first, last in rounds.get(unit, ()):
                known.add_range(first, last)
        accounted = len(known) + life["dropped_unsent"] + life["rejected_local"]
        lost += status.next_round - accounted
    return lost


def render(
    args: argparse.Namespace, kills: list[Kill], summary: RunSummary, elapsed_s: float
) -> str:
    books = summary.ledger
    outer = summary.outer
    ledger = outer if outer is not None else LedgerRecord()
    by_victim = collections.Counter(kill.victim for kill in kills)
    command = (
        f"`.venv/bin/python bench/chaos.py --minutes {args.minutes:g} --seed {args.seed} "
        f"--learners {args.learners} --write`"
    )
    init = outer.evaluation.init if outer is not None else None
    final = outer.evaluation.last if outer is not None else None
    lines = [
        SECTION,
        "",
        f"{command} — `diloco up` (tiny model, {args.learners} learners at slowdown 3, H=10) "
        f"while a random live service (outer, gateway, nats-server or a learner) is killed "
        f"with SIGKILL every {args.min_gap_s:g}–{args.max_gap_s:g} s for {args.minutes:g} "
        f"minutes (seed {args.seed}); then the learners are stopped with SIGTERM and the "
        f"cluster finishes by itself. Whole run {elapsed_s / 60:.1f} min.",
        "",
        "| what | value |",
        "|---|---|",
        f"| kills | {len(kills)}: "
        + ", ".join(f"{k} ×{v}" for k, v in sorted(by_victim.items()))
        + " |",
        f"| restarts by `diloco up` | {summary.restarts} |",
        f"| run ended | {summary.reason} |",
        f"| ledger | **{'balanced' if books.balanced else 'NOT balanced'}** |",
        f"| rounds published (JetStream accepted) | {books.published} |",
        f"| applied exactly once | {books.applied} |",
        f"| rejected with a reason | {books.rejected} ({ledger.rejected}) |",
        f"| redelivered chunks deduplicated | {ledger.deduplicated} |",
        f"| rounds lost in killed learners' memory (never published) | {lost_rounds(summary)} |",
        f"| global version / outer merges | {outer.version if outer is not None else None}"
        f" / {ledger.merges} |",
        f"| held-out loss, nats/byte | {init.nats_per_byte if init else None} → "
        f"{final.nats_per_byte if final else None} |",
        "",
        "Per unit: "
        + json.dumps({str(unit): line.model_dump() for unit, line in books.per_unit.items()}),
        "",
    ]
    if books.problems:
        lines += ["Problems: " + "; ".join(books.problems), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the chaos window")
    parser.add_argument("--seed", type=int, default=0, help="seed of the victims and moments")
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--min-gap-s", type=float, default=5.0, help="shortest time between kills")
    parser.add_argument("--max-gap-s", type=float, default=15.0, help="longest time between kills")
    parser.add_argument("--write", action="store_true", help="write the table to BENCHMARKS.md")
    args = parser.parse_args()
    started = time.monotonic()
    up = start_up(args)
    try:
        wait_for_training(up)
        kills = chaos(args, up)
        log("chaos over: letting the cluster heal, then stopping the learners")
        time.sleep(20)
        stop_learners(up, args.learners)
        code = up.wait(timeout=900)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=120)
    summary = read_summary()
    log((DATA_DIR / "up.out").read_text(errors="replace")[-3000:])
    table = render(args, kills, summary, time.monotonic() - started)
    print(table)
    print("ledger:", summary.ledger.model_dump_json(indent=1))
    if args.write:
        write_section(SECTION, table)
    finished = summary.reason == "finished" and summary.ledger.balanced
    sys.exit(0 if code == 0 and finished else 1)


if __name__ == "__main__":
    main()
