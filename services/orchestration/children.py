"""A supervised child process of ``diloco up``: one ``diloco <service>`` command line, its log,
and how it is started, started again after a crash, and stopped.

Every child runs in its own session (a terminal's Ctrl-C reaches only ``diloco up``, which
decides the order of the shutdown) and is tied to ``diloco up`` with PR_SET_PDEATHSIG, so even a
kill -9 of ``diloco up`` leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.orchestration import nats_server


class Process(Protocol):
    """What the supervision needs of a child: ``subprocess.Popen``'s, or a container's
    (``services.orchestration.compose.docker_api.Container``)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


#: Starts ``diloco <args>`` with extra environment ``env``, appending its output to a log file.
Launch = Callable[[list[str], dict[str, str], Path], Process]
KILL_WAIT_S = 10.0  # how long a killed child may take to be reaped
STACK_DUMP_WAIT_S = 0.5  # time a hung child gets to write its threads' stacks before the kill


def popen(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``diloco <args>`` in its own session, tied to this process, appending its output
    to ``log_path``."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,
            preexec_fn=nats_server.terminate_with_parent,
        )


def log_path_of(logs: Path, name: str) -> Path:
    """The log file of the child called ``name`` (``<job>/learner-1`` logs to
    ``<job>-learner-1.log``)."""
    return logs / f"{name.replace('/', '-')}.log"


@dataclass
class Child:
    """A supervised service process; ``args`` and ``env`` start it again after a crash."""

    name: str
    process: Process
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    launch: Launch = popen

    @classmethod
    def start(
        cls, name: str, args: list[str], env: dict[str, str], logs: Path, launch: Launch = popen
    ) -> Child:
        """Start ``diloco <args>`` as the child ``name``, logging into the folder ``logs``."""
        logs.mkdir(parents=True, exist_ok=True)
        log_path = log_path_of(logs, name)
        return cls(name, launch(args, env, log_path), log_path, args, env, launch)

    @property
    def pid(self) -> int:
        """The process id of the current process."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether the current process is still running."""
        return self.process.poll() is None

    def exit_code(self) -> int | None:
        """The exit code of the current process (negative: killed by that signal), None while it
        runs."""
        return self.process.poll()

    def restart(self, number: int) -> None:
        """Start the same command line again (the log gets a marker line first)."""
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"\n==== diloco up: restart #{number} ====\n".encode())
        self.process = self.launch(self.args, self.env, self.log_path)

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM), if it runs."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def wait_until(self, deadline: float) -> bool:
        """Wait for the process to exit until ``deadline`` (``time.monotonic()``); returns
        whether it exited."""
        try:
            self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill_with_stacks(self) -> None:
        """Kill a hung process after it dumped its threads' stacks into its log (SIGUSR1:
        faulthandler)."""
        self.process.send_signal(signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        self.process.kill()
        self.process.wait(timeout=KILL_WAIT_S)
