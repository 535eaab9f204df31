"""The first section of BENCHMARKS.md: what `make bench` ran, from which stored results, how long
each benchmark took, and whether every section is rendered from stored results.

Reads the ``provenance`` of every ``bench/results/*.json`` (one, or a list: one per invocation
that added runs) and every ``## `` section of BENCHMARKS.md. Its claim: every section names its
raw results file under ``bench/results/`` (exit 1 otherwise).

    .venv/bin/python bench/summary.py --write
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from evidence import Claim, Provenance, exit_on, render_claims
from report import BENCHMARKS, REPO, write_section

SECTION = "## Running the benchmarks"
RESULTS = REPO / "bench" / "results"


def provenances(path: Path) -> list[Provenance]:
    """The provenance(s) a results file holds (its own, or one per part of a file of several
    sections), or one per run of a file that records each run's own (none: a file of another
    shape)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict):
        return []
    found = data.get("provenance")
    items = found if isinstance(found, list) else [found] if found else []
    if not items:
        # bench/throughput.py keeps one set of results, with its provenance, per section.
        items = [
            part["provenance"]
            for part in data.values()
            if isinstance(part, dict) and isinstance(part.get("provenance"), dict)
        ]
    if not items and isinstance(data.get("runs"), dict):
        # bench/links.py keeps each run's commit, command and time instead of one provenance.
        return [
            Provenance(
                commit=run["commit"],
                command=" ".join(run["command"]),
                machine=data.get("machine", ""),
                started="",
                seconds=run["elapsed_s"],
            )
            for run in data["runs"].values()
            if isinstance(run, dict) and {"commit", "command", "elapsed_s"} <= run.keys()
        ]
    return [Provenance.model_validate(item) for item in items]


def sections(text: str) -> dict[str, str]:
    """Each ``## `` section of BENCHMARKS.md by heading, without this one."""
    parts = re.split(r"(?m)^(?=## )", text)
    out = {}
    for part in parts:
        if part.startswith("## "):
            heading = part.splitlines()[0]
            if heading != SECTION:
                out[heading] = part
    return out


def claims(found: dict[str, str]) -> list[Claim]:
    missing = [h for h, body in found.items() if "bench/results/" not in body]
    return [
        Claim(
            "every section of BENCHMARKS.md names its raw results under bench/results/",
            f"{len(found) - len(missing)} of {len(found)}"
            + (f"; not: {', '.join(m[3:] for m in missing)}" if missing else ""),
            bool(found) and not missing,
        )
    ]


def render(files: dict[str, list[Provenance]], checked: list[Claim]) -> str:
    total = sum(p.seconds for ps in files.values() for p in ps)
    lines = [
        SECTION,
        "",
        "`make bench` runs every benchmark below on the shipped defaults and writes its section "
        "from the raw results it stores in `bench/results/` (each section names its command, "
        "commit and file); `make bench-quick` runs a smoke version of each (a small model, few "
        "rows) in a temporary folder, checks that every claim is measured, and writes nothing "
        "here. Each script checks its own claims and exits 1 when one fails. Stored run times "
        "(`.venv/bin/python bench/summary.py --write`):",
        "",
        "| results | invocations or runs | commits | minutes |",
        "|---|---|---|---|",
    ]
    for name, ps in sorted(files.items()):
        commits = ", ".join(dict.fromkeys(f"`{p.commit}`" for p in ps))
        minutes = sum(p.seconds for p in ps) / 60
        lines.append(f"| `bench/results/{name}` | {len(ps)} | {commits} | {minutes:.1f} |")
    lines += [
        f"| **`make bench` in all** | | | **{total / 60:.0f}** |",
        "",
        "(Sections without stored results, listed under the claim below, are not counted.)",
        "",
        render_claims(checked),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    files = {p.name: ps for p in sorted(RESULTS.glob("*.json")) if (ps := provenances(p))}
    checked = claims(sections(BENCHMARKS.read_text()))
    text = render(files, checked)
    print(text)
    if args.write:
        write_section(SECTION, text)
    exit_on(checked)


if __name__ == "__main__":
    main()
