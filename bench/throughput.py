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

* Devices per unit: one learner unit on 1, 2 and 4 devices (``--devices``; on this machine
  CPU devices forced with ``--xla_force_host_platform_device_count``, one process each), the
  service's core and sampler as in the standalone part, ``--batch-size`` sequences per device.
  The unit counts run in turn, ABC then CBA, ...; a row's ratio is the median, over the rounds,
  of its tokens/s over one device's in the same round.

Raw figures (each configuration's tokens/s and eval, each block's tokens/s), each part with its
own provenance: ``bench/results/throughput.json``; running one part keeps the other's. Both
tables are rendered from that file, with ratios to their first row and the claims below them.

    .venv/bin/python bench/throughput.py --write
    .venv/bin/python bench/throughput.py --only standalone --write
    .venv/bin/python bench/throughput.py --only devices --write
    .venv/bin/python bench/throughput.py --render --write   # the sections from the stored file
    .venv/bin/python bench/throughput.py --quick            # the smoke version (tiny model)
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
from evidence import (
    Claim,
    Provenance,
    at_least,
    exit_on,
    note,
    render_claims,
    results_path,
    save,
)
from pydantic import BaseModel
from report import write_section

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
DEVICES_SECTION = "## Devices per learner unit"
DEVICE_COUNTS = (1, 2, 4)
#: Per device: a unit of N devices trains N times the sequences per step.
DEVICES_BATCH = 16
#: A unit of 2 or 4 devices sharing this machine's cores against one device using them all:
#: splitting the batch over the mesh must not cost more than this share of the tokens/s.
MIN_DEVICES_RATIO = 0.7
NAME = "throughput"
PROGRAM = ".venv/bin/python bench/throughput.py"
MIN_CLUSTER_RATIO = 0.9  # 4 learners sharing the cores against 1 learner using them all
MIN_BOUNDARY_RATIO = 0.98  # the boundary-read loop against the every-step one (median of pairs)


class ClusterPart(BaseModel):
    """Each configuration's tokens/s (all units, first inner step to last) and final eval."""

    provenance: Provenance
    rows: dict[str, dict[str, float]] = {}


class StandalonePart(BaseModel):
    """Each row's tokens/s per block, in the order run (AB, BA, ...)."""

    provenance: Provenance
    blocks: dict[str, list[float]] = {}


class DevicesPart(BaseModel):
    """Per unit size (devices), its tokens/s in each round (the rounds in the order run)."""

    provenance: Provenance
    platform: str = "cpu"
    rounds: dict[str, list[float]] = {}


class ThroughputResults(BaseModel):
    """``bench/results/throughput.json``."""

    cluster: ClusterPart | None = None
    standalone: StandalonePart | None = None
    devices: DevicesPart | None = None


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
            note(f"{name:32s} {rates[read_every_step][-1]:10,.0f} tokens/s")
    return rates


def unit_rate(model: str, devices: int, steps: int, h_steps: int) -> float:
    """Tokens/s of one unit of ``devices`` devices over ``steps`` inner steps (after a warm-up
    of as many), as the service's loop runs them: in a process of its own, whose XLA has that
    many CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count="
    env["XLA_FLAGS"] += str(devices)
    child = [sys.executable, __file__, "--unit-child", str(devices), "--model", model]
    child += ["--block-steps", str(steps), "--h-steps", str(h_steps)]
    done = subprocess.run(child, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the {devices}-device unit failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def unit_child(args: argparse.Namespace) -> None:
    """``--unit-child N``: print the tokens/s of a unit on N devices (``unit_rate``)."""
    import jax

    from services.learner.service import build_core
    from services.learner.settings import LearnerSettings
    from shared.runtime import configure_jax

    configure_jax()
    settings = LearnerSettings(
        job="bench",
        model=args.model,
        h_steps=args.h_steps,
        max_steps=2 * args.block_steps,
        dynamic_h=False,
        batch_size=DEVICES_BATCH,
        devices=args.unit_child,
    )
    core, sampler, _ = build_core(settings)
    rates = []
    for _ in range(2):  # the first block compiles and warms up
        started = time.perf_counter()
        for _ in range(args.block_steps):
            core.train_step(sampler.batch(core.step))
            core.due_uploads()
        jax.block_until_ready(core.state)
        rates.append(args.block_steps * core.tokens_per_step / (time.perf_counter() - started))
    print(rates[-1])


def devices_part(args: argparse.Namespace, path: Path) -> DevicesPart:
    configuration = {k: getattr(args, k) for k in ("model", "h_steps", "block_steps", "repeats")}
    configuration["batch_per_device"] = DEVICES_BATCH
    part = DevicesPart(provenance=Provenance.start(PROGRAM, configuration, path))
    started = time.monotonic()
    rounds = max(2, args.repeats // 4)
    for round_ in range(rounds):
        order = DEVICE_COUNTS if round_ % 2 == 0 else DEVICE_COUNTS[::-1]
        for count in order:
            rate = unit_rate(args.model, count, args.block_steps, args.h_steps)
            part.rounds.setdefault(str(count), []).append(rate)
            note(f"round {round_}: {count} device(s) {rate:10,.0f} tokens/s")
    part.provenance.seconds = round(time.monotonic() - started, 1)
    return part


def devices_ratio(part: DevicesPart, count: int) -> float | None:
    """The median over the rounds of a unit of ``count`` devices' tokens/s over one device's."""
    one, many = part.rounds.get("1", []), part.rounds.get(str(count), [])
    if not one or len(one) != len(many):
        return None
    return statistics.median(m / o for m, o in zip(many, one, strict=True))


def devices_table(part: DevicesPart, path: Path) -> str:
    c = part.provenance.configuration
    lines = [
        DEVICES_SECTION,
        "",
        part.provenance.line(path) + f" One learner unit (the service's core and sampler, no "
        f"NATS), model `{c['model']}`, {c['batch_per_device']} sequences per device per step, "
        f"H={c['h_steps']}, on 1, 2 and 4 devices ({part.platform.upper()} devices forced with "
        "`--xla_force_host_platform_device_count`, each in a process of its own): every row "
        "runs on this machine's 2 cores, so a ratio says what splitting the batch over a "
        "mesh costs or gains on the same hardware (XLA runs each CPU device's share on its "
        f"own thread), not what more hardware gains. Each round runs {c['block_steps']} steps per "
        "unit size after as many to warm up; the ratio is the median over the rounds of the "
        "row's tokens/s over one device's in the same round. No GPU row: this run had no GPU.",
        "",
        "| devices per unit | sequences per step | tokens/s (best round) | every round | ratio |",
        "|---|---|---|---|---|",
    ]
    for count in DEVICE_COUNTS:
        rates = part.rounds.get(str(count), [])
        if not rates:
            continue
        ratio = devices_ratio(part, count)
        shown = ", ".join(f"{rate:,.0f}" for rate in rates)
        lines.append(
            f"| {count} | {count * c['batch_per_device']} | {max(rates):,.0f} | {shown} | "
            f"{'-' if ratio is None else f'{ratio:.2f}×'} |"
        )
    return "\n".join(lines) + "\n"


def devices_claims(results: ThroughputResults) -> list[Claim]:
    part = results.devices
    return [
        at_least(
            f"a unit on {count} forced CPU devices keeps ≥ {MIN_DEVICES_RATIO:g}× one device's "
            "tokens/s",
            devices_ratio(part, count) if part else None,
            MIN_DEVICES_RATIO,
            ".2f",
        )
        for count in DEVICE_COUNTS[1:]
    ]


def standalone_part(args: argparse.Namespace, path: Path) -> StandalonePart:
    configuration = {k: getattr(args, k) for k in ("model", "h_steps", "block_steps", "repeats")}
    part = StandalonePart(provenance=Provenance.start(PROGRAM, configuration, path))
    started = time.monotonic()
    rates = standalone_rates(args)
    part.blocks = {name: rates[mode] for name, mode in STANDALONE_ROWS}
    part.provenance.seconds = round(time.monotonic() - started, 1)
    return part


def boundary_ratio(part: StandalonePart) -> float | None:
    """The median, over the pairs of blocks run next to each other, of the boundary-read
    block over the every-step one."""
    first, other = (part.blocks.get(name, []) for name, _ in STANDALONE_ROWS)
    if not first or len(first) != len(other):
        return None
    return statistics.median(r / f for r, f in zip(other, first, strict=True))


def standalone_table(part: StandalonePart, path: Path) -> str:
    c = part.provenance.configuration
    first = part.blocks[STANDALONE_ROWS[0][0]]
    lines = [
        STANDALONE_SECTION,
        "",
        part.provenance.line(path) + " The learner service's core and sampler in one process "
        f"(no NATS), model `{c['model']}`, batch 16, H={c['h_steps']}. Each row runs "
        f"{c['repeats']} blocks of {c['block_steps']} inner steps (each step followed by the "
        "uploads that are due, as in the service's loop), alternating with the other row's "
        "(AB, BA, ...) after one warm-up block. Tokens/s is a row's best block (the one other "
        "work on the machine disturbed least); the ratio is the median, over the pairs of "
        "blocks run next to each other, of the row's block over the first row's.",
        "",
        "| learner loop | tokens/s (best block) | every block (tokens/s) | ratio |",
        "|---|---|---|---|",
    ]
    for name, _ in STANDALONE_ROWS:
        blocks = part.blocks[name]
        ratio = statistics.median(r / f for r, f in zip(blocks, first, strict=True))
        shown = ", ".join(f"{rate:,.0f}" for rate in blocks)
        lines.append(f"| {name} | {max(blocks):,.0f} | {shown} | {ratio:.3f}× |")
    return "\n".join(lines) + "\n"


def cluster_part(args: argparse.Namespace, path: Path) -> ClusterPart:
    configuration = {k: getattr(args, k) for k in ("model", "max_steps", "h_steps")}
    part = ClusterPart(provenance=Provenance.start(PROGRAM, configuration, path))
    started = time.monotonic()
    common = ["--model", args.model, "--max-steps", str(args.max_steps)]
    common += ["--h-steps", str(args.h_steps)]
    cache = Path(tempfile.mkdtemp(prefix="diloco-bench-jax-"))
    for name, extra in CONFIGS:
        figures = run_config(extra, common, cache)
        part.rows[name] = figures
        note(f"{name:34s} {figures['tokens_per_s']:10,.0f} tokens/s  eval {figures['eval']:.3f}")
    part.provenance.seconds = round(time.monotonic() - started, 1)
    return part


def cluster_ratio(part: ClusterPart) -> float | None:
    """4 learners of 1 XLA thread each against 1 learner of 2, in tokens/s."""
    one, four = (part.rows.get(name) for name, _ in CONFIGS[:2])
    if not one or not four or not one["tokens_per_s"]:
        return None
    return four["tokens_per_s"] / one["tokens_per_s"]


def cluster_table(part: ClusterPart, path: Path) -> str:
    c = part.provenance.configuration
    base = next(iter(part.rows.values()))["tokens_per_s"]
    lines = [
        SECTION,
        "",
        part.provenance.line(path) + f" `diloco up` with model `{c['model']}`, "
        f"{c['max_steps']} inner steps per unit, H={c['h_steps']}. Tokens/s are summed over all "
        "units from the first inner step to the last; the ratio is to the first row, measured "
        "in the same run. The eval column is not a quality comparison: a single learner trains "
        "on a quarter of the tokens.",
        "",
        "| configuration | tokens/s | ratio | final eval (nats/byte) |",
        "|---|---|---|---|",
    ]
    for name, figures in part.rows.items():
        lines.append(
            f"| {name} | {figures['tokens_per_s']:,.0f} | {figures['tokens_per_s'] / base:.2f}× "
            f"| {figures['eval']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def cluster_claims(results: ThroughputResults) -> list[Claim]:
    ratio = cluster_ratio(results.cluster) if results.cluster else None
    text = f"4 learners sharing the machine reach ≥ {MIN_CLUSTER_RATIO:g}× one learner's tokens/s"
    return [at_least(text, ratio, MIN_CLUSTER_RATIO, ".2f")]


def standalone_claims(results: ThroughputResults) -> list[Claim]:
    ratio = boundary_ratio(results.standalone) if results.standalone else None
    text = (
        "reading the loss only at upload boundaries is not slower: ≥ "
        f"{MIN_BOUNDARY_RATIO:g}× the every-step loop"
    )
    return [at_least(text, ratio, MIN_BOUNDARY_RATIO, ".3f")]


QUICK = {"model": "tiny", "max_steps": 150, "h_steps": 10, "block_steps": 10, "repeats": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--max-steps", type=int, default=120, help="cluster: steps per unit")
    parser.add_argument("--h-steps", type=int, default=30)
    parser.add_argument(
        "--only", choices=["cluster", "standalone", "devices"], help="run one of the tables only"
    )
    parser.add_argument("--unit-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--block-steps", type=int, default=30, help="standalone: inner steps per block"
    )
    parser.add_argument("--repeats", type=int, default=8, help="standalone: blocks per row")
    parser.add_argument("--render", action="store_true", help="run nothing: render the stored")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    parser.add_argument("--quick", action="store_true", help="smoke run (results elsewhere)")
    args = parser.parse_args()
    if args.unit_child:
        unit_child(args)
        return
    if args.quick:
        vars(args).update(QUICK)
    path = results_path(NAME, args.quick)
    if path.exists() and not args.quick:
        results = ThroughputResults.model_validate_json(path.read_text())
    elif args.render:
        raise SystemExit(f"{path}: no stored results (run bench/throughput.py first)")
    else:
        results = ThroughputResults()
    if not args.render:
        if args.only in (None, "cluster"):
            results.cluster = cluster_part(args, path)
            save(path, results)
        if args.only in (None, "standalone"):
            results.standalone = standalone_part(args, path)
            save(path, results)
        if args.only in (None, "devices"):
            results.devices = devices_part(args, path)
            save(path, results)
    parts = []
    if results.cluster is not None:
        parts.append((SECTION, cluster_table(results.cluster, path), cluster_claims(results)))
    if results.standalone is not None:
        table = standalone_table(results.standalone, path)
        parts.append((STANDALONE_SECTION, table, standalone_claims(results)))
    if results.devices is not None:
        table = devices_table(results.devices, path)
        parts.append((DEVICES_SECTION, table, devices_claims(results)))
    checked = [claim for _, _, part_claims in parts for claim in part_claims]
    for section, table, part_claims in parts:
        text = table + "\n" + render_claims(part_claims)
        print(text)
        if args.write and not args.quick:
            write_section(section, text)
    exit_on(checked, args.quick)


if __name__ == "__main__":
    main()
