"""An asyncio event loop on a virtual clock, for code that paces itself with the loop's timers.

The loop's clock stands still while any callback or socket is ready, and jumps to the next
timer when nothing is: ``await asyncio.sleep(60)`` takes no wall time, and an interval a test
reads from ``loop.time()`` is the one the code under test scheduled, however busy the machine
is. Real I/O still happens: before every jump the loop looks (without waiting) for sockets that
are ready, so servers and clients on loopback within the same loop work as usual.

Code under test must take its time from the running loop (``loop.time()``, ``asyncio.sleep``,
``call_later``), not from ``time.monotonic()``. A wait for another process or thread has no
timer to jump to and blocks as on a real loop; with a timer pending, the clock would jump past
it, so keep such waits out of tests on this loop.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that, instead of sleeping until the next timer, moves the clock to it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is None:  # no timer pending: only I/O can wake the loop
            return super().select(None)
        self.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is the virtual clock (starting at 0)."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a :class:`VirtualClockLoop`."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main)
