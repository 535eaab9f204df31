"""Each attack of the security review, end to end, against the shipped defaults (peer review on).

In a ``diloco up`` run of 4 units (``tiny``, every process its own NATS user), unit 0 sends
hostile uploads with its own valid credentials from its first upload on
(``--adversaries 1 --adversary KIND``, ``services/learner/adversary.py``). The outer refuses
what it can tell apart and bounds what it cannot: the attacker's uploads must be counted under
their reasons, at most two honest uploads refused (``HONEST_REFUSED``), and the attacked job
must train like its 3 honest units alone in the job as configured (``--learners 3 --dn-period
4``, same seed, steps and pacing): what a defence can keep when the attacker's work is refused.

The quality bound here is +``WITHIN`` − 1, one-sided, and wide: on ``tiny`` over 40 steps a
run's end depends on its units' timing. It ends far better when its units stay in step (on an
idle machine they start together and their uploads of a fragment merge as synchronous
DiLoCo's would: about 3.4–3.8 nats/byte) than when the machine's load makes them drift apart
(about 4.2–4.8, where the honest units alone have ended in every run of the suite so far: they
run first, beside another test). Even there, runs of one configuration, two side by side,
spread 6% (the honest units alone ended at 4.18–4.45 over three runs, a sign_flip job at
4.34–4.52), and one CI run had three attacked jobs 5.5–7.7% above the honest units alone; an
undefended sign flip (``--no-peer-review``) ended at 5.06, 14% above the worst of the honest
units alone. The +2% claim is the benchmark's:
``bench/robust.py`` runs the same attacks on ``small`` over 240 steps (BENCHMARKS.md, "Robust
merging"), with 3 seeds of clean runs and 2 hostile units of 8.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.orchestration.local.records import RunSummary
from shared.settings.algorithm import AlgorithmSettings
from tests.helpers import computed_once, run_up_to_end

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

# Paced (slowdown 3), as the other end-to-end tests: unpaced tiny units outrun the outer's
# merges, and the runs spread twice as much. H is fixed (--no-dynamic-h): DyLU scales a unit's
# H by its speed over the fastest unit's, and on a loaded machine one unit read 4x faster than
# the rest cut their H to 2 steps (the job ended at 5.15 nats/byte against 4.78 for the honest
# units alone): noise in the comparison, not the defence under test.
BUDGET = ("--max-steps", "40", "--h-steps", "10", "--seed", "1", "--no-dynamic-h")
PACED = "3"
FRAGMENTS = AlgorithmSettings().fragments  # the shipped default, which every run has
WITHIN = 1.10  # the attacked run's final eval over the honest units' alone, at most
CAUGHT = 0.9  # at least: the share of the attacker's uploads counted under its reasons
# At most, of the honest units' uploads. Two, not none: one CI run refused 2 short uploads of
# one honest unit as implausible_work (steps 30-32 and 36-40). Not the learning rate's decay,
# which the outer now follows (``--learner-steps``): in a 40-step run the learners' warm-up
# spans the whole run. The cause is not known; 12 runs of every attack since refused none.
HONEST_REFUSED = 2


def run(tmp_path: Path, jax_cache: Path, learners: int, *flags: str) -> RunSummary:
    """A whole paced ``diloco up`` run of ``learners`` units to its end; its summary."""
    paced = ",".join([PACED] * learners)
    extra = ("--learners", str(learners), "--slowdowns", paced, *flags)
    return run_up_to_end(tmp_path, jax_cache, *BUDGET, *extra)[0]


def final_eval(summary: RunSummary) -> float:
    assert summary.outer is not None and summary.outer.evaluation.last is not None
    return summary.outer.evaluation.last.nats_per_byte


@pytest.fixture(scope="session")
def honest_alone(tmp_path_factory: pytest.TempPathFactory, jax_cache: Path) -> float:
    """The final eval of the 3 honest units alone in a job of 4's momentum period: run once
    for the whole run (:func:`computed_once`)."""

    def compute() -> str:
        folder = tmp_path_factory.mktemp("honest-alone")
        return repr(final_eval(run(folder, jax_cache, 3, "--dn-period", "4")))

    return float(computed_once(tmp_path_factory, "attacks-honest-alone", compute))


#: What the outer counts each attack's uploads under (refused for these reasons, or clipped),
#: None where it cannot tell them from honest ones (their influence is bounded instead).
REASONS: dict[str, set[str] | None] = {
    "sign_flip": {"direction_outlier"},
    "random": {"direction_outlier", "norm_outlier", "too_frequent"},
    "scaled": {"clipped", "norm_outlier"},
    "alie": None,
    "replay": {"payload_replayed"},
    "too_frequent": {"too_frequent", "implausible_work"},
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("attack", list(REASONS))
def test_one_hostile_unit_of_four_is_counted_and_the_job_trains_as_its_honest_units_alone(
    attack: str, tmp_path: Path, jax_cache: Path, honest_alone: float
) -> None:
    """The attacker's uploads are counted under their reasons (all but its originals, for a
    replay), at most ``HONEST_REFUSED`` of the honest units' are refused, and the job ends as
    its honest units alone would."""
    summary = run(tmp_path, jax_cache, 4, "--adversaries", "1", "--adversary", attack)
    assert summary.outer is not None
    books = summary.outer.units[0]
    published = summary.ledger.per_unit[0].published
    reasons = REASONS[attack]
    if reasons is not None:
        # Any unit's uploads beyond its pace are too_frequent, whatever they hold.
        reasons = reasons | {"too_frequent"}
        counted = sum(n for why, n in books.rejected.items() if why in reasons)
        counted += books.clipped if "clipped" in reasons else 0
        originals = FRAGMENTS if attack == "replay" else 0  # its first upload of each fragment
        assert counted >= CAUGHT * (published - originals), (attack, books, published)
        assert set(books.rejected) <= reasons | {"direction_outlier"}, (attack, books)
    honest = {u: summary.outer.units[u] for u in (1, 2, 3)}
    refused = sum(sum(unit.rejected.values()) for unit in honest.values())
    assert refused <= HONEST_REFUSED, (attack, honest)
    value = final_eval(summary)
    assert value <= WITHIN * honest_alone, (attack, value, honest_alone)
