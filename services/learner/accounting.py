"""What a learner unit's work adds up to, counted on the training thread: tokens trained, the
speed, the seconds spent training (of which computing, of which waiting at sync points), the
loss average, and the lifetime figures the unit's state file keeps across its restarts.

The training loop tells a :class:`TrainingAccount` what happens (a step trained, a running
stretch begun or ended, a wait at a sync point); the status report asks it for a
:class:`Tally` about once a second. Nothing here touches JAX or NATS: a step's loss may stay a
device scalar until a tally reads it, through the ``to_host`` function the loop passes
(``jax.device_get``), and both clocks can be replaced.

Time training counts the running stretches only (not paused, idle, or before the first step).
A unit's *healthy* speed is its tokens over its seconds computing (training minus waiting at
sync points), over its whole life rather than this process's: on shared cores a unit computes
faster while others are down, and a fresh process has little to go by.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.learner.unit_state import UnitState

#: How often a tally writes the lifetime figures (time training and computing, tokens computed)
#: to the state file: each write is fsynced; a killed unit loses at most this much of its
#: counted up time.
LIFETIME_WRITE_S = 2.0
#: The speed is measured from the oldest of the last this-many tallies to now.
RATE_WINDOW_TALLIES = 10


@dataclass(frozen=True)
class Tally:
    """The unit's figures as of one status report.

    Attributes:
        tokens: tokens trained, from the checkpoint's count on (across restarts).
        tokens_per_s: speed over the last tallies of this running stretch.
        training_s: seconds this process spent training.
        compute_tokens_per_s: the healthy speed, over the unit's life (module docstring).
        sync_wait_s: seconds this process waited at sync points (``--mode sync``).
        lifetime_s: seconds since the unit first trained, on its wall clock (None before).
        lifetime_training_s: seconds the unit's processes spent training, over its life.
        train_loss: moving average of the steps' losses (NaN before the first is read).
    """

    tokens: int
    tokens_per_s: float
    training_s: float
    compute_tokens_per_s: float
    sync_wait_s: float
    lifetime_s: float | None
    lifetime_training_s: float
    train_loss: float


class TrainingAccount:
    """The training thread's books of one learner process (not thread-safe: one thread).

    Attributes:
        tokens: tokens trained, from the checkpoint's count on.
        loss_ema: moving average of the losses read so far (NaN before the first).
        sync_wait_s: seconds this process waited at sync points.
    """

    def __init__(
        self,
        unit_state: UnitState,
        tokens: int = 0,
        *,
        to_host: Callable[[Sequence[Any]], Iterable[Any]] = lambda losses: losses,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Args:
        unit_state: the unit's durable record; what earlier processes of the unit counted is
            read from it now, and the lifetime figures are written back to it.
        tokens: tokens trained before this process (the checkpoint's count).
        to_host: turns the steps' losses, in step order, into numbers (``jax.device_get``;
            waits for those steps).
        clock: seconds on a monotonic clock (time spent, speed).
        wall_clock: unix seconds (when the unit first trained, its lifetime).
        """
        self.unit_state = unit_state
        self.tokens = tokens
        self._tokens_at_start = tokens
        # What earlier processes of the unit did: seconds training, of which computing, tokens.
        self._trained_before_s = unit_state.trained_s
        self._computing_before_s = unit_state.computing_s
        self._tokens_before = unit_state.computed_tokens
        self._to_host = to_host
        self._clock = clock
        self._wall_clock = wall_clock
        self.loss_ema = float("nan")
        self._unread_losses: list[Any] = []
        self._rate_window: list[tuple[float, int]] = [(clock(), tokens)]
        self._training_s = 0.0  # finished running stretches of this process
        self._running_since: float | None = None
        self.sync_wait_s = 0.0
        self._lifetime_written_at: float | None = None

    # ---- what happens ------------------------------------------------------------------------

    def start_running(self) -> None:
        """A running stretch begins (no-op while one is under way); the first ever is
        remembered in the state file as when the unit first trained."""
        if self._running_since is not None:
            return
        self._running_since = self._clock()
        self.unit_state.mark_trained(self._wall_clock())

    def stop_running(self) -> None:
        """The running stretch ends (paused, idle or done); no-op when none is under way."""
        if self._running_since is None:
            return
        self._training_s += self._clock() - self._running_since
        self._running_since = None

    def restart_speed(self) -> None:
        """Measure the speed afresh from now (on resuming: a pause is no slow training)."""
        self._rate_window[:] = [(self._clock(), self.tokens)]

    def trained(self, tokens: int, loss: Any) -> None:
        """One step trained ``tokens``; its ``loss`` is read at the next tally."""
        self._unread_losses.append(loss)
        self.tokens += tokens

    def waited_at_sync(self, seconds: float) -> None:
        """The loop waited ``seconds`` for a sync point's merged global."""
        self.sync_wait_s += seconds

    # ---- reading -----------------------------------------------------------------------------

    def tokens_per_s(self) -> float:
        """Speed over the last tallies of this running stretch (0 before any time passed)."""
        t0, tokens0 = self._rate_window[0]
        now = self._clock()
        return (self.tokens - tokens0) / (now - t0) if now > t0 else 0.0

    def tally(self, write_lifetime: bool = False) -> Tally:
        """The figures as of now; writes the lifetime figures to the state file when
        ``write_lifetime`` or ``LIFETIME_WRITE_S`` have passed since the last write (and this
        process has trained at all).

        Reads the losses first: that waits for every step dispatched so far, so only then do
        the tokens counted and the time elapsed describe the same work.
        """
        self._read_losses()
        now = self._clock()
        tokens_per_s = self.tokens_per_s()
        self._rate_window.append((now, self.tokens))
        del self._rate_window[:-RATE_WINDOW_TALLIES]
        training_s = self._training_s
        if self._running_since is not None:
            training_s += now - self._running_since
        life_training_s = self._trained_before_s + training_s
        life_computing_s = self._computing_before_s + max(0.0, training_s - self.sync_wait_s)
        life_tokens = self._tokens_before + self.tokens - self._tokens_at_start
        due = self._lifetime_written_at is None or (
            now - self._lifetime_written_at >= LIFETIME_WRITE_S
        )
        if training_s > 0 and (write_lifetime or due):
            self.unit_state.set_lifetime(life_training_s, life_computing_s, life_tokens)
            self._lifetime_written_at = now
        first = self.unit_state.first_trained_at
        return Tally(
            tokens=self.tokens,
            tokens_per_s=tokens_per_s,
            training_s=training_s,
            compute_tokens_per_s=life_tokens / life_computing_s if life_computing_s > 0 else 0.0,
            sync_wait_s=self.sync_wait_s,
            lifetime_s=None if first is None else max(0.0, self._wall_clock() - first),
            lifetime_training_s=life_training_s,
            train_loss=self.loss_ema,
        )

    def _read_losses(self) -> None:
        for loss in self._to_host(self._unread_losses):
            value = float(loss)
            # An exponential moving average over about the last ten steps' losses.
            self.loss_ema = (
                value if math.isnan(self.loss_ema) else 0.9 * self.loss_ema + 0.1 * value
            )
        self._unread_losses.clear()
