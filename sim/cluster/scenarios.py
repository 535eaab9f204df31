"""The clusters ``bench/scaling.py`` simulates, with every input figure and where it comes from.

1. **The small cluster of ``bench/goodput.py``**, one simulated cluster per real run: its
   units' measured healthy speeds, its measured upload size, its seeded failures, and two
   figures fitted on the real runs (:class:`Calibration`): a killed unit's restart time (from
   the decoupled runs with failures) and the outer's seconds per merge of each method (from the
   runs without failures). The runs with failures of the other methods are then predictions.
2. **Chip scale** (:func:`chip_scale`): the setting the paper's goodput table describes
   (secondary sources, ``../shared/research/algorithms.md`` §1.7–1.8): chips failing on their
   own with a mean time between interruptions of one year each, 150k to 2.4M chips. A
   failure-domain model: a plain data-parallel job restarts on every failure; an elastic one
   stalls while it shrinks and again when the chip returns; Decoupled DiLoCo's M learners are
   elastic slices of N/M chips, and so are synchronous DiLoCo's, which meet at every sync point.
   The stall and restart times are not published: they are fitted to the paper's elastic and
   plain data-parallel figures at 1.2M chips (:func:`fit_chip_scale`), and every other figure
   of the sweep is a prediction.
3. **The 12B model over four regions** (:func:`twelve_b`): compute time per step assumed, link
   rates of 2 and 5 Gbit/s as in the seed, bytes per sync from the model size and the codecs.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.learner.settings import CheckpointSettings
from shared.link_spec import parse_link
from sim.cluster.engine import simulate
from sim.cluster.model import Cluster, Failure, GoodputRun, Link, Method, Outcome, Unit

YEAR_S = 365.25 * 24 * 3600

# ---- 1. the small cluster of bench/goodput.py --------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Figures of the real system the simulator cannot derive, fitted on the real runs."""

    restart_s: float  # a killed unit's time to train again after its repair
    merge_s: dict[str, float]  # the outer's seconds per merge (round), by method
    params_bytes: dict[str, float]  # one global as a unit downloads it, by method
    checkpoint_every_s: float = CheckpointSettings.model_fields["checkpoint_every_s"].default
    sync_timeout_s: float = 10.0  # bench/goodput.py's --sync-timeout-s


def failures_of(run: GoodputRun) -> tuple[Failure, ...]:
    """The run's injected failures on the units' clock (those of the outer or nats-server are
    not modelled; bench/goodput.py injects none). A failure that began before the units started
    counts for what was left of it."""
    offset = run.chaos_offset_s or 0.0
    failures = []
    for event in run.chaos:
        if not event.target.startswith("learner-"):
            continue
        at = event.at_s - offset
        down = event.repair_s + min(0.0, at)
        if down > 0:
            failures.append(Failure(max(0.0, at), int(event.target[8:]), event.kind, down))
    return tuple(sorted(failures, key=lambda f: f.at_s))


def link_of(run: GoodputRun) -> Link:
    """The run's link per unit (none: loopback, not a bottleneck)."""
    if run.link is None:
        return Link()
    spec = parse_link(run.link)
    return Link(rate_bps=spec.rate_bps, latency_s=spec.delay_s)


def small_cluster(run: GoodputRun, calibration: Calibration) -> Cluster:
    """The simulated twin of one ``bench/goodput.py`` run."""
    units = tuple(
        Unit(
            step_s=run.tokens_per_step / speed,
            tokens_per_step=run.tokens_per_step,
            restart_s=calibration.restart_s,
        )
        for _, speed in sorted(run.speeds.items(), key=lambda kv: int(kv[0]))
        if speed > 0
    )
    method = Method(
        mode="decoupled" if run.method == "decoupled" else "sync",
        h_steps=run.h_steps,
        upload_bytes=run.upload_bytes,
        params_bytes=calibration.params_bytes[run.method],
        merge_s=calibration.merge_s[run.method],
        sync_timeout_s=calibration.sync_timeout_s,
        checkpoint_every_s=calibration.checkpoint_every_s,
    )
    return Cluster(
        units=units, link=link_of(run), method=method, steps=run.steps, failures=failures_of(run)
    )


def fit_restart_s(runs: Sequence[GoodputRun]) -> float:
    """A killed unit's time to train again after its repair: the units' measured down time
    (window × (1 − up share)) beyond the scheduled repairs of kills and pauses, per kill."""
    extra, kills = 0.0, 0
    for run in runs:
        failures = failures_of(run)
        for unit, window in run.windows.items():
            mine = [f for f in failures if f.unit == int(unit) and f.at_s < window]
            scheduled = sum(min(f.down_s, window - f.at_s) for f in mine if f.kind != "cut")
            measured = window * (1 - run.unit_up.get(unit, 1.0))
            extra += measured - scheduled
            kills += sum(f.kind == "kill" for f in mine)
    return max(0.0, extra / kills) if kills else 0.0


def mean_window_s(run: GoodputRun) -> float:
    """The units' mean goodput window in a real run (from their start to their end)."""
    return sum(run.windows.values()) / len(run.windows) if run.windows else 0.0


def fit_merge_s(run: GoodputRun, calibration: Calibration) -> float:
    """The outer's seconds per round in a run without failures: the value that makes the
    simulated units end when the real ones did (mean window, found by bisection)."""
    target = mean_window_s(run)

    def window(merge_s: float) -> float:
        fitted = dataclasses.replace(
            calibration, merge_s={**calibration.merge_s, run.method: merge_s}
        )
        windows = simulate(small_cluster(run, fitted)).windows_s
        return sum(windows) / len(windows)

    if window(0.0) >= target:
        return 0.0
    return bisect(window, target, 0.0, target)


def bisect(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """The x in [lo, hi] where the increasing ``f`` reaches ``target`` (to 1e-3 relative)."""
    for _ in range(40):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-3 * max(hi, 1e-9):
            break
    return (lo + hi) / 2


# ---- 2. chip scale -------------------------------------------------------------------------

#: Chips per job in the paper's goodput table (secondary sources).
CHIP_COUNTS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
#: The paper's goodput at those chip counts, MTBI one year per chip (one summary's Table 1;
#: the 1.2M column — 27% / 58% / 88% — is confirmed by several sources).
PAPER_GOODPUT = {
    "data-parallel": (0.72, 0.57, 0.38, 0.27, 0.18),
    "elastic data-parallel": (0.88, 0.80, 0.69, 0.58, 0.40),
    "decoupled M=8": (0.98, 0.96, 0.94, 0.88, 0.80),
}


@dataclass(frozen=True)
class ChipScale:
    """Inputs of the chip-scale model (see the module's docstring for their sources)."""

    mtbi_chip_s: float = YEAR_S  # paper: one year per chip
    step_s: float = 1.0  # assumed; goodput hardly depends on it (failures cost seconds)
    h_steps: int = 100  # assumed sync period of the DiLoCo methods
    learners: int = 8  # paper: M = 8
    stall_s: float = 10.0  # elastic: seconds a slice stalls on a failure, and again on return
    restart_s: float = 60.0  # plain data-parallel: seconds to restart after a failure
    repair_s: float = 3600.0  # assumed: a failed chip's return (only elastic upscale uses it)
    sync_timeout_s: float = 30.0  # synchronous DiLoCo's wait for a stalled learner
    horizon_s: float = 6 * 3600.0  # simulated wall-clock per point
    seed: int = 0


def _poisson(rate: float, horizon: float, rng: random.Random) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < horizon:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def chip_scale(method: str, chips: int, c: ChipScale) -> Outcome:
    """Goodput of ``method`` (``data-parallel``, ``elastic data-parallel``,
    ``sync DiLoCo M=<m>`` or ``decoupled M=<m>``) on ``chips`` chips."""
    rng = random.Random(f"{c.seed}/{method}/{chips}")
    if method in ("data-parallel", "elastic data-parallel"):
        learners, mode = 1, "sync"
    else:
        learners = int(method.rsplit("=", 1)[1])
        mode = "decoupled" if method.startswith("decoupled") else "sync"
    rate = chips / learners / c.mtbi_chip_s  # failures per second of one unit
    failures: list[Failure] = []
    for unit in range(learners):
        # Chips failed up to one repair time before the start still return during the run.
        for drawn in _poisson(rate, c.horizon_s + c.repair_s, rng):
            at = drawn - c.repair_s
            if method == "data-parallel":
                if at >= 0:
                    failures.append(Failure(at, unit, "kill", c.restart_s))
                continue
            # An elastic slice stalls to shrink, and again to grow back when the chip returns.
            for stall_at in (at, at + c.repair_s):
                if 0 <= stall_at < c.horizon_s:
                    failures.append(Failure(stall_at, unit, "pause", c.stall_s))
    h = 1 if learners == 1 else c.h_steps
    cluster = Cluster(
        units=tuple(Unit(step_s=c.step_s, tokens_per_step=1) for _ in range(learners)),
        link=Link(),
        method=Method(
            mode=mode,  # type: ignore[arg-type]
            h_steps=h,
            upload_bytes=0.0,
            params_bytes=0.0,
            merge_s=0.0,
            sync_timeout_s=c.sync_timeout_s,
            # A data-parallel job checkpoints often; what a restart loses is in restart_s.
            checkpoint_every_s=c.step_s if method == "data-parallel" else 0.0,
        ),
        horizon_s=c.horizon_s,
        failures=tuple(sorted(failures, key=lambda f: f.at_s)),
    )
    return simulate(cluster)


def fit_chip_scale(c: ChipScale, chips: int = 1_200_000) -> ChipScale:
    """``c`` with the elastic stall and the plain restart time fitted to the paper's elastic
    and plain data-parallel goodput at ``chips`` chips."""
    column = CHIP_COUNTS.index(chips)

    def fitted(name: str, field: str, target: float, hi: float) -> float:
        def loss_share(value: float) -> float:  # increasing in value
            return 1 - chip_scale(name, chips, dataclasses.replace(c, **{field: value})).goodput

        return bisect(loss_share, 1 - target, 0.0, hi)

    stall = fitted(
        "elastic data-parallel", "stall_s", PAPER_GOODPUT["elastic data-parallel"][column], 200.0
    )
    restart = fitted("data-parallel", "restart_s", PAPER_GOODPUT["data-parallel"][column], 600.0)
    return dataclasses.replace(c, stall_s=stall, restart_s=restart)


# ---- 3. 12B over four regions --------------------------------------------------------------


@dataclass(frozen=True)
class TwelveB:
    """Inputs of the 12B time budget (seed: 12B parameters, four regions, 2–5 Gbit/s)."""

    params: float = 12e9
    regions: int = 4
    step_s: float = 1.0  # assumed compute time of one inner step in every region
    h_steps: int = 100  # assumed sync period of the DiLoCo methods
    steps: int = 2_000  # simulated inner steps per region (the budget is per 1,000 steps)
    merge_s: float = 10.0  # assumed: the decoupled outer applies one 12B update in 10 s
    latency_s: float = 0.035  # one-way delay between US regions (assumed)


def twelve_b(method: str, gbit_s: float, t: TwelveB) -> Outcome:
    """One method over links of ``gbit_s`` per region, without failures.

    Bytes: data-parallel all-reduces bf16 gradients every step, a ring moving
    2(M−1)/M × 2 bytes per parameter each way per region; synchronous DiLoCo all-reduces bf16
    pseudo-gradients every H steps the same way; decoupled uploads int4 pseudo-gradients
    (0.5 byte per parameter plus 1/64 for block scales) and downloads int8 globals
    (1 + 1/64 bytes per parameter) without waiting for either.
    """
    ring = 2 * (t.regions - 1) / t.regions * 2 * t.params / 2  # each way: half up, half down
    if method == "data-parallel":
        mode, h, up, down = "sync", 1, ring, ring
    elif method == "sync DiLoCo":
        mode, h, up, down = "sync", t.h_steps, ring, ring
    elif method == "decoupled":
        mode, h, up, down = "decoupled", t.h_steps, t.params * (0.5 + 1 / 64), t.params * 65 / 64
    else:
        raise ValueError(f"unknown method {method!r}")
    cluster = Cluster(
        units=tuple(Unit(step_s=t.step_s, tokens_per_step=1) for _ in range(t.regions)),
        link=Link(rate_bps=gbit_s * 1e9, latency_s=t.latency_s),
        method=Method(
            mode=mode,  # type: ignore[arg-type]
            h_steps=h,
            upload_bytes=up,
            params_bytes=down,
            merge_s=t.merge_s if method == "decoupled" else 0.0,  # all-reduce: no outer
        ),
        steps=t.steps,
    )
    return simulate(cluster)
