"""The one retry policy of every service: exponential backoff with jitter, through ``stamina``.

Every loop that retries a failed network call goes through :func:`retry`: the wait before
attempt n is ``min(max_s, initial_s * 2**(n-1) + uniform(0, jitter_s))``, so that after a
nats-server restart the clients do not all come back on the same schedule. A call is
retried only for the errors its caller names (NATS being unreachable, by default), for ever
unless ``attempts`` or ``within_s`` say otherwise, and stops being retried once ``stopping()``
is true (the last error is then raised to the caller).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import stamina
import stamina.instrumentation

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Errors that mean "NATS did not answer or is unreachable": worth another try.
NATS_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, OSError, nats.errors.Error)

# Each retry is logged below with what was being done; stamina's own log lines and its
# Prometheus counter (in the process-global registry, which nothing here scrapes) stay off.
stamina.instrumentation.set_on_retry_hooks([])


@dataclass(frozen=True)
class Backoff:
    """How long to wait between attempts (seconds)."""

    initial_s: float = 0.5
    max_s: float = 5.0
    jitter_s: float = 0.5


DEFAULT = Backoff()
#: For the calls a broker failover holds up (the outer's fetches, lease and checkpoint, every
#: chunk publish). In a JetStream cluster a stream or consumer whose leader died answers "no
#: responders" at once until nats-server's Raft elects a new leader, 4-9 s later; retrying
#: every quarter second at most (each try costs the server one "no responders" answer) reaches
#: the new leader within 0.35 s of its election.
QUICK = Backoff(initial_s=0.1, max_s=0.25, jitter_s=0.1)


async def retry(
    call: Callable[[], Awaitable[T]],
    what: str,
    *,
    on: tuple[type[BaseException], ...] | Callable[[BaseException], bool] = NATS_ERRORS,
    attempts: int | None = None,
    within_s: float | None = None,
    stopping: Callable[[], bool] | None = None,
    on_error: Callable[[str], None] | None = None,
    backoff: Backoff = DEFAULT,
) -> T:
    """``await call()`` until it returns, retrying the errors ``on`` names.

    Args:
        call: makes a fresh awaitable for each attempt.
        what: names the call in the log and in ``on_error`` messages.
        on: the retryable error types, or a predicate on the error.
        attempts: the most attempts in all (None: no limit).
        within_s: no attempt starts after this many seconds from the first (None: no limit).
        stopping: when it returns true after a failure, that failure is raised instead.
        on_error: told ``"<what>: <error>"`` after every retried failure.
        backoff: the waits between attempts.

    Raises:
        Whatever ``call`` raised that is not retried, or the last error once ``attempts`` or
        ``within_s`` are used up or ``stopping()`` is true.
    """

    def retryable(err: BaseException) -> bool:
        wanted = isinstance(err, on) if isinstance(on, tuple) else on(err)
        if not wanted or (stopping is not None and stopping()):
            return False
        if on_error is not None:
            on_error(f"{what}: {err}")
        log.warning("%s failed (%r); retrying", what, err)
        return True

    async for attempt in stamina.retry_context(
        on=retryable,
        attempts=attempts,
        timeout=within_s,
        wait_initial=backoff.initial_s,
        wait_max=backoff.max_s,
        wait_jitter=backoff.jitter_s,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable: stamina raises the last error when it gives up")
