"""Chaos run: ``diloco up`` while random services are killed with ``kill -9``; books balance.

Starts a local cluster (``diloco up``, tiny model), and for ``--minutes`` kills a random live
service every few seconds — the outer, the gateway, nats-server or a learner, chosen and timed
by a seeded RNG — with SIGKILL, reading their PIDs from ``<data-dir>/pids.json``. ``diloco up``
restarts each one. After the chaos window and ``--heal-s`` seconds to heal, the learners are
stopped gracefully (SIGTERM: they upload what they have and exit 0), the cluster finishes by
itself, and its final summary (``<data-dir>/summary.json``) is checked: every round any unit
published was applied exactly once or rejected with a reason (``shared.ledger.balance``).

The raw results (every kill, ``diloco up``'s exit status and its whole summary) go to
``bench/results/chaos.json`` with the run's provenance; the section is rendered from that file,
with the claims of README.md and docs/RELIABILITY.md (``claims``) checked against it. Exit
status 1 when one fails or is not measured (the run did not finish, the books did not balance,
a kind of service was not killed repeatedly, ...). ``--quick`` is the smoke version: half a
minute of chaos with 2 learners, a kill every 2–4 s, results in a temporary folder.

    .venv/bin/python bench/chaos.py --write                  # 5 minutes of chaos (about 6 min)
    .venv/bin/python bench/chaos.py --render --write         # the section from the stored run
    .venv/bin/python bench/chaos.py --quick
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
from typing import Any, NamedTuple

from evidence import (
    Claim,
    Provenance,
    at_least,
    note,
    publish,
    render_claims,
    results_path,
    save,
)
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.orchestration.local import files
from services.orchestration.local.records import RunSummary
from shared.ledger import Books, RoundSet
from shared.records.outer import LedgerRecord

SECTION = "## Reliability: chaos run of `diloco up`"
NAME = "chaos"
PROGRAM = ".venv/bin/python bench/chaos.py"
RESULTS = results_path(NAME, quick=False)
DATA_DIR = REPO / "bench" / ".cache" / "chaos"
HEAL_S = 20.0  # after the chaos window, before the learners are stopped
#: The kinds of service the chaos kills (a learner's name is ``learner-<unit>``).
KINDS = ("outer", "gateway", "nats-server", "learner")
# The claims' bounds: README.md, "When something dies" ("`bench/chaos.py` does this for 5
# minutes at random") and docs/RELIABILITY.md ("any service, repeatedly, for 5 minutes | `diloco
# up` restarts it; the run finishes with balanced books").
DOCUMENTED_MINUTES = 5.0
KILLS_PER_KIND = 2  # "repeatedly"
QUICK = {"minutes": 0.5, "learners": 2, "min_gap_s": 2.0, "max_gap_s": 4.0, "heal_s": 5.0}


def log(message: str) -> None:
    note(message)


class Kill(NamedTuple):
    """One SIGKILL of the chaos window."""

    t: float  # seconds into the window
    victim: str  # the child's name in pids.json


class ChaosResults(BaseModel):
    """``bench/results/chaos.json``: the kills, how ``diloco up`` exited (None: not yet, or it
    never started) and its ``summary.json`` (None: missing or malformed)."""

    provenance: Provenance
    kills: list[Kill] = []
    returncode: int | None = None
    summary: RunSummary | None = None


# Its annotations are strings: resolve them here, as a module loaded from its file under another
# name (tests/test_local_chaos_report.py) is not in sys.modules for pydantic to look them up.
ChaosResults.model_rebuild()


def kind(victim: str) -> str:
    """The kind of service a child is: ``learner-2`` is a learner."""
    return re.sub(r"-[0-9]+$", "", victim)


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


def missing_summary() -> RunSummary:
    """What a missing or malformed ``summary.json`` reads as: a run that did not end well."""
    missing = f"no readable {DATA_DIR / files.SUMMARY_FILE}"
    return RunSummary(reason=missing, elapsed_s=0, ledger=Books(balanced=False, problems=[missing]))


def read_summary() -> RunSummary:
    """The run's ``summary.json``; a missing or malformed one reads as a run that did not end
    well, so that the table says so and the exit status is 1."""
    summary = files.read_summary(DATA_DIR)
    return summary if summary is not None else missing_summary()


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


def claims(results: ChaosResults) -> list[Claim]:
    """What README.md ("When something dies") and docs/RELIABILITY.md say a chaos run shows,
    checked against the stored run. Without a summary the run did not finish, and what only
    the summary can show is not measured."""
    summary = results.summary
    c = results.provenance.configuration
    out = [
        at_least(
            f"minutes of chaos ≥ the documented {DOCUMENTED_MINUTES:g} (README.md, "
            "docs/RELIABILITY.md)",
            c.get("minutes"),
            DOCUMENTED_MINUTES,
            ".1f",
        )
    ]
    by_kind = collections.Counter(kind(k.victim) for k in results.kills)
    counts = ", ".join(f"{k} ×{by_kind[k]}" for k in KINDS)
    out.append(
        Claim(
            f"every kind of service ({', '.join(KINDS)}) was killed repeatedly, each at least "
            f"{KILLS_PER_KIND} times (docs/RELIABILITY.md: 'any service, repeatedly')",
            counts,
            all(by_kind[k] >= KILLS_PER_KIND for k in KINDS),
        )
    )
    finished = "the run finished by itself (`diloco up` exited 0, its summary says 'finished')"
    if summary is None:
        ended = "no summary" if results.returncode is not None else "not measured"
        out.append(Claim(finished, ended, False if results.returncode is not None else None))
    else:
        out.append(
            Claim(
                finished,
                f"exit {results.returncode}, '{summary.reason}'",
                results.returncode == 0 and summary.reason == "finished",
            )
        )
    if summary is None:
        texts = [
            "every killed service was restarted by `diloco up` (README.md)",
            "the books balance (`shared.ledger.balance`)",
            "every round JetStream accepted was applied exactly once or rejected with a reason",
            "the held-out loss fell",
        ]
        return out + [Claim(text, "not measured", None) for text in texts]
    killed = collections.Counter(k.victim for k in results.kills)
    short = [
        f"{name} {summary.restarts.get(name, 0)} < {n}"
        for name, n in sorted(killed.items())
        if summary.restarts.get(name, 0) < n
    ]
    out.append(
        Claim(
            "every killed service was restarted by `diloco up` (README.md): its restarts ≥ its "
            "kills, for each",
            "; ".join(short)
            or f"{sum(summary.restarts.values())} restarts, {len(results.kills)} kills",
            not short,
        )
    )
    books = summary.ledger
    out.append(
        Claim(
            "the books balance (`shared.ledger.balance`: every published round applied or "
            "rejected, none both, none applied twice)",
            "balanced" if books.balanced else "; ".join(books.problems) or "not balanced",
            books.balanced,
        )
    )
    out.append(
        Claim(
            "every round JetStream accepted was applied exactly once or rejected with a reason "
            "(README.md, docs/RELIABILITY.md): applied + rejected = published (recorded by "
            "the units, or acked to a unit killed before its record) > 0",
            f"{books.applied} + {books.rejected} of {books.published} + {books.unrecorded}",
            books.published > 0
            and books.applied + books.rejected == books.published + books.unrecorded,
        )
    )
    evaluation = summary.outer.evaluation if summary.outer is not None else None
    init = evaluation.init.nats_per_byte if evaluation and evaluation.init else None
    last = evaluation.last.nats_per_byte if evaluation and evaluation.last else None
    fell = "the held-out loss fell through the chaos (last evaluation below the first), nats/byte"
    if init is None or last is None:
        out.append(Claim(fell, "not measured", None))
    else:
        out.append(Claim(fell, f"{init:.4f} → {last:.4f}", last < init))
    return out


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counter.items()))


def section(results: ChaosResults, checked: list[Claim], path: Path) -> str:
    """The section, from the stored results only."""
    p = results.provenance
    c: dict[str, Any] = p.configuration
    summary = results.summary if results.summary is not None else missing_summary()
    books = summary.ledger
    outer = summary.outer
    ledger = outer if outer is not None else LedgerRecord()
    by_victim = collections.Counter(kill.victim for kill in results.kills)
    init = outer.evaluation.init if outer is not None else None
    final = outer.evaluation.last if outer is not None else None
    lines = [
        SECTION,
        "",
        p.line(path) + f" `diloco up` (tiny model, {c.get('learners')} learners at slowdown "
        f"3, H=10) while a random live service (outer, gateway, nats-server or a learner) is "
        f"killed with SIGKILL every {c.get('min_gap_s', 0):g}–{c.get('max_gap_s', 0):g} s for "
        f"{c.get('minutes', 0):g} minutes (seed {c.get('seed')}); then, {c.get('heal_s', 0):g} "
        "s later, the learners are stopped with SIGTERM and the cluster finishes by itself.",
        "",
        "| what | value |",
        "|---|---|",
        f"| kills | {len(results.kills)}: {_counts(by_victim)} |",
        f"| restarts by `diloco up` | {sum(summary.restarts.values())}: "
        f"{_counts(summary.restarts)} |",
        f"| run ended | {summary.reason} (`diloco up` exit status {results.returncode}) |",
        f"| ledger | **{'balanced' if books.balanced else 'NOT balanced'}** |",
        f"| rounds published (JetStream accepted), recorded by their units | {books.published} |",
        "| rounds published, acked to a unit killed before it recorded the ack "
        f"| {books.unrecorded} |",
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
    lines.append(render_claims(checked))
    return "\n".join(lines)


def configuration(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings, as its provenance stores them."""
    keys = ("minutes", "seed", "learners", "min_gap_s", "max_gap_s")
    return {
        **{key: getattr(args, key) for key in keys},
        "heal_s": getattr(args, "heal_s", HEAL_S),
        "model": "tiny",
        "slowdown": 3,
        "h_steps": 10,
        "batch_size": 8,
        "eval_every_s": 5,
        "data_dir": str(DATA_DIR),
    }


def render(
    args: argparse.Namespace,
    kills: list[Kill],
    summary: RunSummary,
    elapsed_s: float,
    returncode: int | None = None,
) -> str:
    """The section of a run in hand, as :func:`section` renders stored results."""
    results = ChaosResults(
        provenance=Provenance.start(PROGRAM, configuration(args)),
        kills=kills,
        returncode=returncode,
        summary=summary,
    )
    results.provenance.seconds = elapsed_s
    return section(results, claims(results), RESULTS)


def measure(args: argparse.Namespace, path: Path) -> ChaosResults:
    """One chaos run, saved when it starts, after the chaos window and at its end."""
    results = ChaosResults(provenance=Provenance.start(PROGRAM, configuration(args), path))
    started = time.monotonic()

    def checkpoint() -> None:
        results.provenance.seconds = round(time.monotonic() - started, 1)
        save(path, results)

    checkpoint()
    up = start_up(args)
    try:
        wait_for_training(up)
        results.kills = chaos(args, up)
        checkpoint()
        log("chaos over: letting the cluster heal, then stopping the learners")
        time.sleep(args.heal_s)
        stop_learners(up, args.learners)
        up.wait(timeout=900)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=120)
        results.returncode = up.returncode
        results.summary = files.read_summary(DATA_DIR)
        checkpoint()
    log((DATA_DIR / "up.out").read_text(errors="replace")[-3000:])
    return results


def main() -> None:
    global DATA_DIR
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the chaos window")
    parser.add_argument("--seed", type=int, default=0, help="seed of the victims and moments")
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--min-gap-s", type=float, default=5.0, help="shortest time between kills")
    parser.add_argument("--max-gap-s", type=float, default=15.0, help="longest time between kills")
    parser.add_argument("--heal-s", type=float, default=HEAL_S, help="wait after the chaos")
    parser.add_argument("--render", action="store_true", help="run nothing: render the stored")
    parser.add_argument("--write", action="store_true", help="write the table to BENCHMARKS.md")
    parser.add_argument("--quick", action="store_true", help="smoke version: half a minute")
    args = parser.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    path = results_path(NAME, args.quick)
    if args.quick:  # the cluster's files beside the results, not in bench/.cache
        DATA_DIR = path.parent / "chaos-data"
    if args.render:
        if not path.exists():
            raise SystemExit(f"{path}: no stored results (run bench/chaos.py first)")
        results = ChaosResults.model_validate_json(path.read_text())
    else:
        results = measure(args, path)
    checked = claims(results)
    text = section(results, checked, path)
    publish(SECTION, text, checked, args.write, args.quick)


if __name__ == "__main__":
    main()
