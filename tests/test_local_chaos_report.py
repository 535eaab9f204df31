"""``bench/chaos.py`` reads ``diloco up``'s files through the models: a missing or malformed
``pids.json`` or ``summary.json`` gives no victims and a failed run's table, never a crash."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from services.orchestration.local.records import RunSummary
from shared.ledger import balance
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStatus
from tests.helpers import REPO

ARGS = argparse.Namespace(minutes=1.0, seed=0, learners=1, min_gap_s=5.0, max_gap_s=15.0)


@pytest.fixture
def chaos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("chaos_under_test", REPO / "bench" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DATA_DIR", tmp_path)
    yield module
    sys.modules.pop("chaos_under_test", None)


def test_missing_or_malformed_files_give_no_victims_and_a_failed_table(chaos, tmp_path):
    assert chaos.pids() == {}
    (tmp_path / "pids.json").write_text('{"supervisor": "me", "pids": []}')
    (tmp_path / "summary.json").write_text("[1, 2")
    assert chaos.pids() == {}
    summary = chaos.read_summary()
    assert not summary.ledger.balanced and "no readable" in summary.reason
    table = chaos.render(ARGS, [chaos.Kill(1.0, "outer")], summary, 60.0)
    assert "| ledger | **NOT balanced** |" in table and "| kills | 1: outer ×1 |" in table


def test_a_finished_runs_table_counts_rounds_lost_in_killed_learners(chaos, tmp_path):
    published = [(0, 3)]
    units = {
        0: UnitStatus(
            unit=0,
            state="stopped",
            published_rounds=published,
            next_round=7,  # 4 published, 1 dropped unsent, 2 lost with a killed process
            lifetime={"dropped_unsent": 1},
        )
    }
    outer = OuterStatus(
        state="running",
        model="tiny",
        holder="h",
        version=4,
        applied=4,
        applied_rounds={0: published},
    )
    summary = RunSummary(
        reason="finished", elapsed_s=300, outer=outer, units=units, ledger=balance(outer, units)
    )
    (tmp_path / "summary.json").write_bytes(summary.model_dump_json().encode())
    assert chaos.read_summary() == summary
    table = chaos.render(ARGS, [], summary, 300.0)
    assert "| ledger | **balanced** |" in table
    assert "| rounds lost in killed learners' memory (never published) | 2 |" in table
    assert "| global version / outer merges | 4 / 0 |" in table
