"""The simulated-clock engine of the quality benchmark: the shipped algorithm and codecs (the
settings' defaults, as ``diloco up`` runs them) on the tiny model."""

from __future__ import annotations

import copy
import dataclasses

import jax
import pytest

from shared import data, evaluation, model
from shared.link_spec import parse_link
from shared.settings.algorithm import AlgorithmSettings
from shared.settings.workload import WorkloadSettings
from sim import training as sim

# Only the workload is made small: the algorithm and the codecs are the shipped defaults.
WORKLOAD = WorkloadSettings(model="tiny", max_steps=60)
SETUP = sim.SimSetup(workload=WORKLOAD, num_units=2, evals=2)
SPEEDS = [1.0, 2.0]  # slowdowns of the two units


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


@pytest.fixture(scope="module")
def shipped(work, start):
    """The shipped setup's asynchronous run at ``SPEEDS``."""
    return sim.async_run(work, start, SPEEDS)


def test_the_setup_is_the_shipped_algorithm():
    assert SETUP.algorithm == AlgorithmSettings()
    assert SETUP.algorithm.outer_optimizer == "delayed_nesterov"
    assert SETUP.codec.codec == "int8" and SETUP.codec.params_codec == "int8"
    assert (SETUP.codec.params_downlink, SETUP.codec.params_delta_codec) == ("delta", "int4")


def test_every_method_learns_and_reports_a_curve(work, start, shipped):
    results = [sim.data_parallel(work, start), sim.sync_diloco(work, start), shipped]
    for result in results:
        assert result.curve[0][0] == 0 and result.curve[-1][1] == result.final_eval
        assert result.final_eval < result.curve[0][1] - 0.3, result.method
    h = SETUP.algorithm.h_steps
    assert results[1].outer_steps == -(-SETUP.steps_per_unit // h)  # one per H steps


def test_async_with_quorum_and_dylu_merges_equal_speed_units_together(work, start):
    quorum = sim.changed(
        SETUP.algorithm, outer_optimizer="nesterov", merge_policy="quorum", min_quorum=1
    )
    result = sim.async_run(work, start, SPEEDS, algorithm=quorum)
    # With DyLU the slow unit does H/2 steps per round, so both arrive together: every merge
    # takes both updates and nothing is stale.
    assert result.merged_per_step == 2.0
    assert set(result.staleness) == {0}


def test_simulation_is_deterministic(work, start, shipped):
    again = sim.async_run(work, start, SPEEDS)
    assert again.final_eval == shipped.final_eval and again.staleness == shipped.staleness


def test_paced_fetches_carry_fewer_bytes_down_and_learn(work, start, shipped):
    """``params_fetches_per_period`` 1: a unit's next fetch of a fragment waits H steps."""
    paced = sim.changed(SETUP.algorithm, params_fetches_per_period=1)
    result = sim.async_run(work, start, SPEEDS, algorithm=paced)
    assert result.bytes_down < 0.8 * shipped.bytes_down, (result.bytes_down, shipped.bytes_down)
    assert result.final_eval < result.curve[0][1] - 0.3


def test_async_with_copies_of_the_params_learns(work, start):
    """Globals reach the units as copies in the params codec (``--params-downlink copy``), not
    as the outer's deltas (shared.downlink), which the shipped setup runs."""
    copies = SETUP.codec.model_copy(update={"params_downlink": "copy"})
    result = sim.async_run(work, start, SPEEDS, codec_settings=copies)
    assert result.final_eval < result.curve[0][1] - 0.3


def test_units_stagger_their_fragments_over_a_slow_link_only(work, start):
    """``--stagger auto`` with 3 fragments: the units start aligned. Over 100 kbit/s a
    whole-model upload of ``tiny`` holds the link for more than a fifth of a period, so they
    stagger; without a link they never do."""
    three = sim.changed(SETUP.algorithm, fragments=3)
    fast = sim.async_run(work, start, SPEEDS, algorithm=three)
    slow_work = copy.copy(work)
    slow_work.setup = dataclasses.replace(SETUP, link=parse_link("100kbit/10ms"))
    slow = sim.async_run(slow_work, start, SPEEDS, algorithm=three)
    assert fast.staggered == [False, False]
    assert slow.staggered == [True, True]
    assert slow.final_eval < slow.curve[0][1] - 0.3
