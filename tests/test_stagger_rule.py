"""When a unit staggers its fragments (``--stagger``)."""

from __future__ import annotations

import pytest

from services.learner.stagger_rule import STAGGER_SHARE, should_stagger


@pytest.mark.parametrize(
    ("mode", "fragments", "upload_s", "period_s", "expected"),
    [
        ("auto", 5, 6.0, 20.0, True),  # 1 Mbit/s: the model holds the link 30% of a period
        ("auto", 5, 0.2, 20.0, False),  # an uncapped link
        ("auto", 5, STAGGER_SHARE * 20.0, 20.0, False),  # at the share exactly: not yet
        ("auto", 1, 60.0, 20.0, False),  # one fragment: nothing to spread
        ("auto", 5, None, 20.0, False),  # no upload measured yet
        ("auto", 5, 6.0, None, False),  # no speed measured yet
        ("never", 5, 60.0, 20.0, False),
        ("always", 5, 60.0, 20.0, False),  # staggered from the start, never asked
    ],
)
def test_a_unit_staggers_when_the_whole_model_holds_its_link_too_long(
    mode, fragments, upload_s, period_s, expected
):
    assert should_stagger(mode, fragments, upload_s, period_s) is expected
