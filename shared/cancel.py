"""Cancellation that is not lost in forever-loops of asyncio tasks."""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """End the current task if it was asked to.

    A cancel sent while a task awaits a future that then completes anyway (a NATS reply that
    lands as the cancel comes; ``asyncio.wait_for``'s race in Python 3.11) is consumed by that
    future, and a ``while True`` loop would run on past its owner's shutdown. Loops call this
    once per pass.

    Raises:
        asyncio.CancelledError: the current task has a cancel pending.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
