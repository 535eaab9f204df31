"""When a unit staggers its fragments (``--stagger``): a pure rule, which the learner runs on
its measured upload and step times and the quality simulator on its simulated ones.

With P > 1 fragments a unit starts with them aligned: every H steps its P uploads go out
together, the whole model at once, as with one fragment. Over a slow link that batch holds the
link for a good part of the period, and its last fragment reaches the outer long after the step
it was computed at. Staggered (``LearnerCore.stagger``), fragment p is due ``offset(p)`` steps
early once and then every H steps, so each upload crosses the link alone, in about 1/P of the
time, and arrives that much fresher (Streaming DiLoCo, arXiv 2501.18512). Over a fast link
there is no lag to shorten, and the P times as many separate merges, versions and fetches
cost quality and some speed (without a cap, staggered from the start: 3.5% worse final eval,
0.96x the slowest unit's speed; docs/ALGORITHMS.md, "Staleness"). So ``auto`` staggers once a
whole-model upload takes more than ``STAGGER_SHARE`` of the period's time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.settings.algorithm import StaggerName

if TYPE_CHECKING:
    from services.learner.core import LearnerCore, Upload

#: ``auto`` staggers once a whole-model upload takes more than this share of a sync period.
STAGGER_SHARE = 0.2


def should_stagger(
    mode: StaggerName, fragments: int, upload_s: float | None, period_s: float | None
) -> bool:
    """Whether an aligned unit should stagger its fragments now.

    Args:
        mode: the ``--stagger`` setting (``always`` staggers from the start, ``never`` never).
        fragments: P.
        upload_s: seconds the unit's last whole-model upload (its last P uploads) held its
            link (None: not measured yet).
        period_s: seconds of one sync period at the unit's measured speed (None: unknown).
    """
    if mode != "auto" or fragments < 2 or upload_s is None or not period_s:
        return False
    return upload_s > STAGGER_SHARE * period_s


def stagger_if_slow(
    core: LearnerCore,
    uploads: list[Upload],
    mode: StaggerName,
    upload_s: float | None,
    period_s: float | None,
) -> bool:
    """After ``core`` took ``uploads``: if they were its aligned fragments, the whole model at
    once, and :func:`should_stagger` says so, stagger the fragments from now on
    (``LearnerCore.stagger`` over the period ``core.current_h``). Returns whether it did."""
    fragments = core.plan.count
    if len(uploads) != fragments or core.staggered:
        return False
    if not should_stagger(mode, fragments, upload_s, period_s):
        return False
    core.stagger(core.current_h)
    return True
