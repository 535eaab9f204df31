"""``run_up`` from start to end with a real nats-server and stand-in services (tiny Python
processes, no JAX): SIGINT and SIGTERM stop the whole cluster with exit code 0, and an outer
left dead ends the run with exit code 1; either way every child is stopped, ``pids.json`` is
emptied and ``summary.json`` says why the run ended."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.orchestration.children import Launch
from services.orchestration.local import files
from services.orchestration.local.run import run_up
from services.orchestration.local.settings import UpSettings

# Each stand-in says it is ready and runs until SIGTERM (then exits 0, as a service that stopped
# cleanly); an outer that ``crash``es exits 3 at once.
RUN = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
RUN += "print('ready', flush=True); time.sleep(60)"
CRASH = "raise SystemExit(3)"
EVERYONE = {"nats-server", "outer", "gateway", "learner-0", "learner-1"}


def stand_ins(crashing: str = "") -> tuple[list[subprocess.Popen[bytes]], Launch]:
    """A launcher of stand-in services, and the processes it started."""
    started: list[subprocess.Popen[bytes]] = []

    def launch(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        script = CRASH if args[0] == crashing else RUN
        with open(log_path, "ab") as log_file:
            started.append(subprocess.Popen([sys.executable, "-c", script], stdout=log_file))
        return started[-1]

    return started, launch


def settings(tmp_path: Path, max_restarts: int = 1000) -> UpSettings:
    return UpSettings(learners=2, data_dir=str(tmp_path), gateway_port=0, max_restarts=max_restarts)


def signal_when_all_started(data_dir: Path, signum: int) -> threading.Thread:
    """Send ``signum`` to this process once pids.json lists every child and each service
    stand-in says it is ready (it handles SIGTERM)."""

    def ready(name: str) -> bool:
        log = data_dir / "logs" / f"{name}.log"
        return log.exists() and "ready" in log.read_text()

    def watch() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            record = files.read_pids(data_dir)
            listed = record is not None and set(record.pids) >= EVERYONE
            if listed and all(ready(name) for name in EVERYONE - {"nats-server"}):
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_child_and_the_run_ends_well(tmp_path, signum):
    started, launch = stand_ins()
    out = io.StringIO()
    watcher = signal_when_all_started(tmp_path, signum)
    assert run_up(settings(tmp_path), out=out, launch=launch) == 0, out.getvalue()
    watcher.join(timeout=5)
    text = out.getvalue()
    assert f"signal {signum}: stopping the cluster" in text
    assert text.rstrip().endswith("all services stopped")
    assert len(started) == 4 and all(p.poll() == 0 for p in started), text  # stopped cleanly
    pids = files.read_pids(tmp_path)
    assert pids is not None and pids.pids == {}
    summary = files.read_summary(tmp_path)
    assert summary is not None and summary.reason == "interrupted"


@pytest.mark.timeout(120)
def test_an_outer_left_dead_ends_the_run_with_an_error_and_stops_the_rest(tmp_path):
    started, launch = stand_ins(crashing="outer")
    out = io.StringIO()
    assert run_up(settings(tmp_path, max_restarts=0), out=out, launch=launch) == 1
    text = out.getvalue()
    reason = "stopped: outer exited with code 3 and was not restarted (max-restarts 0 reached)"
    assert f"run {reason}" in text, text
    assert "all services stopped" in text
    assert all(p.poll() is not None for p in started)
    pids = files.read_pids(tmp_path)
    assert pids is not None and pids.pids == {}
    summary = files.read_summary(tmp_path)
    assert summary is not None and summary.reason == reason
