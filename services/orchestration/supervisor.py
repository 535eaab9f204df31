"""The restart policy of ``diloco up``: which exited child comes back, after how long, and when
to give up on it.

Pure bookkeeping, no processes and no clock of its own: the cluster reports starts and exits with
the current ``time.monotonic()`` and asks which restarts are due. The backoff starts at 1 s and
doubles up to 10 s per child; a child that ran for 60 s or more before it exited starts again from
1 s. After ``max_restarts`` restarts a child is left dead. A child that may finish (a learner)
and exits with code 0 is done, not restarted. A child that is *retired* (stopped on purpose, e.g.
the outer of a job that was stopped) is done whatever its exit code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 10.0
RESET_AFTER_S = 60.0
DEFAULT_MAX_RESTARTS = 1000


@dataclass(frozen=True)
class RestartPolicy:
    """How exited children are restarted."""

    initial_backoff_s: float = INITIAL_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    reset_after_s: float = RESET_AFTER_S
    max_restarts: int = DEFAULT_MAX_RESTARTS

    def next_backoff_s(self, previous_s: float | None, ran_s: float) -> float:
        """The delay before the next restart of a child that exited after running ``ran_s``
        seconds, whose previous restart waited ``previous_s`` (None: never restarted)."""
        if previous_s is None or ran_s >= self.reset_after_s:
            return self.initial_backoff_s
        return min(self.max_backoff_s, previous_s * 2)


class State(enum.Enum):
    """Where a supervised child stands."""

    RUNNING = "running"
    WAITING = "waiting"  # exited, restart scheduled
    FINISHED = "finished"  # exited 0 where that means done (a learner)
    GAVE_UP = "gave up"  # exited with its restarts used up: left dead


@dataclass(frozen=True)
class Decision:
    """What happens to a child that exited with ``code`` (negative: killed by that signal)."""

    name: str
    code: int
    state: State
    delay_s: float = 0.0
    restart: int = 0  # the number of the coming restart, from 1 (WAITING only)
    max_restarts: int = 0

    def line(self) -> str:
        """The line ``diloco up`` prints about it (empty for a child that finished)."""
        if self.state is State.WAITING:
            return (
                f"{self.name} exited with code {self.code}; "
                f"restart #{self.restart} in {self.delay_s:.1f}s"
            )
        if self.state is State.GAVE_UP:
            return (
                f"{self.name} exited with code {self.code}; not restarted: "
                f"max-restarts {self.max_restarts} reached"
            )
        return ""


@dataclass
class _Record:
    may_finish: bool
    started_at: float
    state: State = State.RUNNING
    restarts: int = 0
    backoff_s: float | None = None
    restart_at: float = 0.0
    retired: bool = False
    hold_until: float = 0.0  # an injected failure: not restarted before this


class Supervisor:
    """Restart bookkeeping of a set of named children under one ``RestartPolicy``."""

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self._records: dict[str, _Record] = {}

    def add(self, name: str, now: float, *, may_finish: bool = False) -> None:
        """Register a child started at ``now``; ``may_finish``: exit code 0 means it is done."""
        self._records[name] = _Record(may_finish=may_finish, started_at=now)

    def state(self, name: str) -> State:
        """Where the child stands."""
        return self._records[name].state

    def running(self) -> list[str]:
        """Names of the children believed to be running (exits not yet reported)."""
        return [name for name, r in self._records.items() if r.state is State.RUNNING]

    def exited(self, name: str, code: int, now: float) -> Decision:
        """Report that a running child exited with ``code`` at ``now``; schedules its restart
        unless it finished or used up its restarts."""
        record = self._records[name]
        if record.state is not State.RUNNING:
            raise ValueError(f"{name} is not running ({record.state.value})")
        limit = self.policy.max_restarts
        if record.retired or (record.may_finish and code == 0):
            record.state = State.FINISHED
            return Decision(name, code, State.FINISHED, max_restarts=limit)
        if record.restarts >= limit:
            record.state = State.GAVE_UP
            return Decision(name, code, State.GAVE_UP, max_restarts=limit)
        record.backoff_s = self.policy.next_backoff_s(record.backoff_s, now - record.started_at)
        delay_s = max(record.backoff_s, record.hold_until - now)
        record.restart_at = now + delay_s
        record.state = State.WAITING
        return Decision(
            name,
            code,
            State.WAITING,
            delay_s=delay_s,
            restart=record.restarts + 1,
            max_restarts=limit,
        )

    def hold(self, name: str, until: float) -> None:
        """The child is being failed on purpose (``diloco up`` chaos): when it exits, it is not
        restarted before ``until`` (nor, if it is already waiting for a restart, before then)."""
        record = self._records[name]
        record.hold_until = until
        if record.state is State.WAITING:
            record.restart_at = max(record.restart_at, until)

    def retire(self, name: str) -> None:
        """The child is being stopped on purpose: its exit (any code) is final, and a restart
        already scheduled is cancelled."""
        record = self._records[name]
        record.retired = True
        if record.state is State.WAITING:
            record.state = State.FINISHED

    def retired(self) -> set[str]:
        """Names of the retired children."""
        return {name for name, r in self._records.items() if r.retired}

    def states(self) -> dict[str, State]:
        """Where every child stands, by name."""
        return {name: r.state for name, r in self._records.items()}

    def due(self, now: float) -> list[str]:
        """Names of the children whose restart time has come."""
        return [
            name
            for name, r in self._records.items()
            if r.state is State.WAITING and r.restart_at <= now
        ]

    def restarted(self, name: str, now: float) -> int:
        """Report that a waiting child was started again at ``now``; returns its restart count."""
        record = self._records[name]
        if record.state is not State.WAITING:
            raise ValueError(f"{name} has no restart scheduled ({record.state.value})")
        record.state = State.RUNNING
        record.started_at = now
        record.restarts += 1
        return record.restarts

    def restarts(self) -> dict[str, int]:
        """Restarts so far of every child, in the order they were added."""
        return {name: r.restarts for name, r in self._records.items()}
