"""Held-out evaluations of the global params, off the outer's event loop."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.outer.core import OuterCore
from shared import pytree
from shared.evaluation import EvalResult
from shared.records.outer import EvalRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalCopy:
    """A copy of the global params to evaluate: which version, and when it was taken."""

    params: Any
    version: int
    taken_at: float


class Evaluator:
    """Evaluates copies of the global params with ``evaluate`` (the held-out loss)."""

    def __init__(self, evaluate: Callable[[Any], EvalResult], template: Any) -> None:
        self.evaluate = evaluate
        self.template = template

    def copy(self, core: OuterCore) -> EvalCopy:
        """A copy of the global params and their version. Take it on the event loop between
        merges (merges run on a worker thread)."""
        params = pytree.unflatten_named(self.template, core.full_params())
        return EvalCopy(params, core.total_version, time.time())

    async def run(self, copy: EvalCopy, tokens: int) -> EvalRecord:
        """Evaluate ``copy`` on a worker thread; ``tokens``: applied by the outer so far. A
        loss that is not finite (a diverged model) is entered as None and logged."""
        result = await asyncio.get_running_loop().run_in_executor(None, self.evaluate, copy.params)
        log.info(
            "eval v%d: %.4f nats/byte (%.4f bits/byte)",
            copy.version,
            result.nats_per_byte,
            result.bits_per_byte,
        )
        if not all(map(math.isfinite, (result.nats_per_byte, result.bits_per_byte))):
            log.warning(
                "the evaluation of version %d is not finite: the model diverged", copy.version
            )
        return EvalRecord(
            version=copy.version,
            tokens=tokens,
            nats_per_byte=_finite(result.nats_per_byte),
            bits_per_byte=_finite(result.bits_per_byte),
            at=round(copy.taken_at, 3),
        )


def _finite(loss: float) -> float | None:
    """A loss rounded for the status record, or None when it is not finite."""
    return round(loss, 5) if math.isfinite(loss) else None
