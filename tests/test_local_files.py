"""The files ``diloco up`` leaves in its data folder (``services.orchestration.local.files``):
written atomically through the models of ``shared.records``, read back without ever raising."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from services.orchestration.local import files
from services.orchestration.local.records import PidsFile, RunSummary
from shared import atomic
from shared.ledger import balance
from shared.records.outer import OuterStatus
from shared.records.unit import UnitStatus
from tests.strategies import record_bytes


def test_pids_round_trip(tmp_path: Path):
    pids = PidsFile(
        supervisor=10,
        nats_url="nats://127.0.0.1:4222",
        pids={"nats-server": 11, "outer": 12, "j/learner-0": 13},
        restarts={"outer": 2, "learner-0": 0},
    )
    files.write_pids(tmp_path, pids)
    assert files.read_pids(tmp_path) == pids
    assert not atomic.temp_file(tmp_path / files.PIDS_FILE).exists()


def test_summary_round_trip(tmp_path: Path):
    outer = OuterStatus(
        state="running",
        model="tiny",
        holder="h",
        version=3,
        applied=2,
        applied_rounds={0: [(0, 1)]},
    )
    units = {0: UnitStatus(unit=0, step=7, published_rounds=[(0, 1)], train_loss=3.5)}
    summary = RunSummary(
        reason="finished",
        elapsed_s=12.5,
        outer=outer,
        units=units,
        tokens_per_s=99.0,
        restarts={"outer": 1},
        ledger=balance(outer, units),
    )
    files.write_summary(tmp_path, summary)
    back = files.read_summary(tmp_path)
    assert back == summary and back is not None and back.ledger.balanced


def test_missing_or_malformed_files_read_as_none(tmp_path: Path):
    assert files.read_pids(tmp_path) is None and files.read_summary(tmp_path) is None
    (tmp_path / files.PIDS_FILE).write_text('{"supervisor": 1, "pids": {"outer": "twelve"}}')
    (tmp_path / files.SUMMARY_FILE).write_text(json.dumps({"reason": "finished"}))
    assert files.read_pids(tmp_path) is None and files.read_summary(tmp_path) is None
    (tmp_path / files.PIDS_FILE).unlink()
    (tmp_path / files.PIDS_FILE).mkdir()  # unreadable as a file
    assert files.read_pids(tmp_path) is None


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=record_bytes(PidsFile, RunSummary))
def test_no_content_of_pids_or_summary_makes_a_reader_crash(tmp_path: Path, data: bytes):
    (tmp_path / files.PIDS_FILE).write_bytes(data)
    (tmp_path / files.SUMMARY_FILE).write_bytes(data)
    pids, summary = files.read_pids(tmp_path), files.read_summary(tmp_path)
    assert pids is None or isinstance(pids, PidsFile)
    assert summary is None or isinstance(summary, RunSummary)


def test_token_file_is_private_and_replaced_atomically(tmp_path: Path):
    data_dir = tmp_path / "d"
    path = files.write_token(data_dir, "abc")
    assert path.read_text() == "abc\n" and (path.stat().st_mode & 0o777) == 0o600
    path.chmod(0o644)
    stale = atomic.temp_file(path)
    stale.write_text("left by a crash")
    stale.chmod(0o644)
    assert files.write_token(data_dir, "def") == path
    assert path.read_text() == "def\n" and (path.stat().st_mode & 0o777) == 0o600
    assert not stale.exists()
