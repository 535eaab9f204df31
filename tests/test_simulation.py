"""The simulated-clock engine of the quality benchmark, on the tiny model."""

from __future__ import annotations

import jax
import pytest

from services.learner.core import SyncSchedule
from services.outer.core import OuterAlgorithm
from services.outer.staleness import StalenessRule
from shared import data, evaluation, model
from sim import training as sim

SETUP = sim.SimSetup(model="tiny", num_units=2, steps_per_unit=12, h_steps=4, evals=2)


@pytest.fixture(scope="module")
def work():
    cfg = model.get_config("tiny")
    text = b"the quick brown fox jumps over the lazy dog. " * 4000
    corpus = data.split_corpus(text, 0.05)
    evaluate = evaluation.make_evaluator(cfg, data.eval_batches(corpus.heldout, cfg.seq_len, 4, 2))
    return sim.Workload(SETUP, corpus, evaluate)


@pytest.fixture(scope="module")
def start():
    return model.init_params(model.get_config("tiny"), jax.random.PRNGKey(0))


def test_every_method_learns_and_reports_a_curve(work, start):
    results = [
        sim.data_parallel(work, start),
        sim.sync_diloco(work, start),
        sim.async_run(work, start, OuterAlgorithm(num_units=2), [1.0, 2.0], SyncSchedule(4)),
    ]
    for result in results:
        assert result.curve[0][0] == 0 and result.curve[-1][1] == result.final_eval
        assert result.final_eval < result.curve[0][1] - 0.3, result.method
    assert results[1].outer_steps == 3  # 12 steps / H=4


def test_async_with_quorum_and_dylu_merges_equal_speed_units_together(work, start):
    algorithm = OuterAlgorithm(
        policy="quorum", min_quorum=1, num_units=2, token_weighting="tokens2_per_step"
    )
    result = sim.async_run(work, start, algorithm, [1.0, 2.0], SyncSchedule(4), dynamic=True)
    # With DyLU the slow unit does H/2 steps per round, so both arrive together: every merge
    # takes both updates and nothing is stale.
    assert result.merged_per_step == 2.0
    assert set(result.staleness) == {0}


def test_simulation_is_deterministic(work, start):
    algorithm = OuterAlgorithm(num_units=2, staleness=StalenessRule("constant"))
    first = sim.async_run(work, start, algorithm, [1.0, 3.0], SyncSchedule(4))
    second = sim.async_run(work, start, algorithm, [1.0, 3.0], SyncSchedule(4))
    assert first.final_eval == second.final_eval and first.staleness == second.staleness
