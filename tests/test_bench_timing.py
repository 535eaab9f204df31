"""The claims of ``bench/timing.py`` hold for figures within their ranges and fail for figures
outside them, and a case the run did not measure fails even a quick run. Results are built by
hand: nothing is timed here."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from shared.link_spec import parse_outages
from tests.helpers import REPO


@pytest.fixture
def timing(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("timing_under_test", REPO / "bench" / "timing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic looks the module up for the annotations
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def failures(claims, quick: bool = False):
    from evidence import failures as of  # bench/ is on sys.path in these tests

    return of(claims, quick)


def results(timing: ModuleType, only: str | None = None, **figures):
    """A full run's results that meet every claim, but for ``figures``: ``seen`` (Mbit/s at
    each cap, over the cap), ``added_s`` (the delay's added round trip), ``off_s`` (how late
    each outage began), ``changes_s`` (versions after the kill)."""
    from evidence import Provenance

    configuration = {
        "only": only,
        "rates_mbit": timing.RATES_MBIT,
        "rate_seconds": 2.0,
        "delay_s": timing.DELAY_S,
        "round_trips": 20,
        "outages": timing.OUTAGES,
        "sync_timeout_s": 6.0,
        "sync_watch_s": 12.0,
        "sync_rounds": 2,
    }
    out = timing.TimingResults(
        provenance=Provenance(
            commit="abc1234",
            command=".venv/bin/python bench/timing.py",
            machine="test",
            started="2026-01-01T00:00:00+00:00",
            seconds=60.0,
            configuration=configuration,
        )
    )
    if only in (None, "link"):
        for mbit in timing.RATES_MBIT:
            size, first = int(mbit * 1e6 / 8 * 2), 2500
            seen = figures.get("seen", 1.0) * mbit * 1e6
            out.rates.append(
                timing.RateRun(
                    mbit=mbit,
                    size=size,
                    first_chunk=first,
                    first_s=100.0,
                    last_s=100.0 + (size - first) * 8 / seen,
                )
            )
        direct = [0.0001] * 20
        added = figures.get("added_s", 2 * timing.DELAY_S)
        out.delay = timing.DelayRun(
            delay_s=timing.DELAY_S, direct_s=direct, shaped_s=[d + added for d in direct]
        )
        off = figures.get("off_s", 0.005)
        out.outages = [
            timing.OutageRun(
                outage=o,
                seen_from_s=o.start_s + off,
                seen_to_s=o.start_s + o.duration_s,
            )
            for o in parse_outages(timing.OUTAGES)
        ]
    if only in (None, "sync"):
        out.sync = timing.SyncRun(
            timeout_s=6.0,
            rounds=2,
            changes_s=figures.get("changes_s", [0.4, 6.5, 7.4]),
            watched_s=12.0,
        )
    return out


def verdicts(claims) -> dict[str, bool | None]:
    return {claim.text.split(":")[0]: claim.holds for claim in claims}


def test_good_figures_meet_every_claim_and_render_from_the_stored_json(timing, tmp_path):
    good = results(timing)
    stored = timing.TimingResults.model_validate_json(good.model_dump_json())
    claims = timing.claims(stored)
    assert len(claims) == 7 and all(claim.holds for claim in claims)
    assert failures(claims) == []
    text = timing.render(stored, claims, tmp_path / "timing.json")
    assert text.startswith(timing.SECTION + "\n\n`.venv/bin/python bench/timing.py` at commit")
    assert "- holds: sync hold" in text and "longest gap 6.10 s" in text
    assert "| rate at 100 Mbit/s | 25,000,000 bytes in" in text


@pytest.mark.parametrize(
    ("figures", "failing"),
    [
        ({"seen": 0.85}, {"rate at 1 Mbit/s", "rate at 10 Mbit/s", "rate at 100 Mbit/s"}),
        ({"seen": 1.12}, {"rate at 1 Mbit/s", "rate at 10 Mbit/s", "rate at 100 Mbit/s"}),
        ({"added_s": 0.056}, {"delay 25 ms"}),
        ({"added_s": 0.044}, {"delay 25 ms"}),
        ({"off_s": 0.06}, {"200ms+200ms", "600ms+200ms"}),
        ({"changes_s": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]}, {"sync hold"}),
    ],
)
def test_figures_out_of_range_fail_their_claims_but_not_a_quick_run(timing, figures, failing):
    claims = timing.claims(results(timing, **figures))
    assert {name for name, holds in verdicts(claims).items() if holds is False} == failing
    assert {c.text.split(":")[0] for c in failures(claims)} == failing
    assert failures(claims, quick=True) == []


def test_an_outage_never_seen_fails(timing):
    bad = results(timing)
    bad.outages[1].seen_from_s = bad.outages[1].seen_to_s = None
    claims = timing.claims(bad)
    assert verdicts(claims)["600ms+200ms"] is False
    assert [c.measured for c in failures(claims)] == ["never seen in mode cut"]


def test_a_part_left_out_is_not_measured_and_fails_even_a_quick_run(timing):
    claims = timing.claims(results(timing, only="link"))
    assert verdicts(claims)["sync hold"] is None
    assert [c.text.split(":")[0] for c in failures(claims, quick=True)] == ["sync hold"]
    claims = timing.claims(results(timing, only="sync"))
    assert len(failures(claims, quick=True)) == 6
