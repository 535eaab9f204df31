"""What a shaped link is: its rate, one-way delay and jitter, and its scheduled outages.

Written as text on command lines and in settings, in ``tc``'s units:

* a link: ``RATE[/DELAY[/JITTER]]``, e.g. ``100mbit/25ms``, ``20mbit/50ms/5ms``,
  ``unlimited/10ms``. RATE is a number with ``bit``, ``kbit``, ``mbit`` or ``gbit`` (powers of
  1000, bits per second), or ``unlimited``; DELAY and JITTER a number with ``us``, ``ms`` or
  ``s``. The rate caps each direction on its own; the delay is one way, so a round trip
  takes twice as long.
* an outage: ``START+DURATION[:MODE]``, e.g. ``30s+5s`` or ``1m+10s:cut``, START counted from
  the link's start. MODE ``stall`` (the default) holds every byte until the outage ends, like a
  link that stops forwarding; ``cut`` closes every connection and refuses new ones until it
  ends, like a link that went down.

No implementation is imported: ``diloco up``'s settings parse these.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat

OutageMode = Literal["stall", "cut"]

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_NUMBER = r"(\d+(?:\.\d+)?)"
_RATE = re.compile(rf"^{_NUMBER}\s*(bit|kbit|mbit|gbit)$", re.IGNORECASE)
_TIME = re.compile(rf"^{_NUMBER}\s*(us|ms|s|m)$", re.IGNORECASE)
UNLIMITED = "unlimited"


class LinkSpec(BaseModel):
    """One link's shape, the same in both directions.

    Attributes:
        rate_bps: the cap of each direction in bits per second (None: no cap).
        delay_s: one-way delay added to every byte.
        jitter_s: each chunk's delay varies uniformly within ±jitter (order is kept).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    rate_bps: PositiveFloat | None = None
    delay_s: NonNegativeFloat = Field(0.0, le=60.0)
    jitter_s: NonNegativeFloat = Field(0.0, le=60.0)

    @property
    def rate_bytes_per_s(self) -> float | None:
        """The cap in bytes per second (None: no cap)."""
        return self.rate_bps / 8 if self.rate_bps is not None else None

    def text(self) -> str:
        """The spec as it is written on a command line (parses back to the same spec, to 12
        significant digits)."""
        rate = UNLIMITED if self.rate_bps is None else _in_units(self.rate_bps, _RATE_UNITS, "bit")
        parts = [rate, _in_units(self.delay_s, _TIME_UNITS, "ms")]
        if self.jitter_s:
            parts.append(_in_units(self.jitter_s, _TIME_UNITS, "ms"))
        return "/".join(parts)


class Outage(BaseModel):
    """One scheduled outage of a link.

    Attributes:
        start_s: when it begins, in seconds after the link started.
        duration_s: how long it lasts.
        mode: ``stall`` (bytes are held) or ``cut`` (connections are closed and refused).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    start_s: NonNegativeFloat
    duration_s: PositiveFloat
    mode: OutageMode = "stall"

    def text(self) -> str:
        """The outage as it is written on a command line."""
        start, duration = (_in_units(t, _TIME_UNITS, "s") for t in (self.start_s, self.duration_s))
        return f"{start}+{duration}:{self.mode}"


def _plain(value: float) -> str:
    """A number as the parsers read it: positional, never with an exponent."""
    return f"{Decimal(repr(value)).normalize():f}"


def _in_units(value: float, units: dict[str, float], fallback: str) -> str:
    """``value`` in the largest of ``units`` it reaches (``20mbit``, ``25ms``), to 12
    significant digits; in ``fallback`` when it reaches none (zero: ``0ms``)."""
    reached = [unit for unit, factor in units.items() if value >= factor]
    unit = max(reached, key=units.__getitem__) if reached else fallback
    return f"{_plain(float(f'{value / units[unit]:.12g}'))}{unit}"


def parse_rate(text: str) -> float | None:
    """Bits per second of ``100mbit``-style text; None for ``unlimited``.

    Raises:
        ValueError: the text is not a rate, or the rate is zero.
    """
    text = text.strip()
    if text.lower() == UNLIMITED:
        return None
    match = _RATE.match(text)
    if match is None:
        raise ValueError(f"expected a rate like 100mbit, 512kbit or unlimited, got {text!r}")
    value = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"a link's rate must be above zero, got {text!r}")
    return value


def parse_duration(text: str) -> float:
    """Seconds of ``25ms``-style text (units ``us``, ``ms``, ``s``, ``m``).

    Raises:
        ValueError: the text is not a duration.
    """
    match = _TIME.match(text.strip())
    if match is None:
        raise ValueError(f"expected a duration like 25ms, 1.5s or 2m, got {text!r}")
    return float(match.group(1)) * _TIME_UNITS[match.group(2).lower()]


def parse_link(text: str) -> LinkSpec:
    """A :class:`LinkSpec` from ``RATE[/DELAY[/JITTER]]``.

    Raises:
        ValueError: the text does not describe a link (the message says what is expected).
    """
    parts = text.strip().split("/")
    if not 1 <= len(parts) <= 3 or not parts[0]:
        raise ValueError(f"expected a link like 100mbit/25ms or 20mbit/50ms/5ms, got {text!r}")
    rate = parse_rate(parts[0])
    delay = parse_duration(parts[1]) if len(parts) > 1 else 0.0
    jitter = parse_duration(parts[2]) if len(parts) > 2 else 0.0
    if jitter > delay:
        raise ValueError(f"a link's jitter ({parts[2]}) cannot exceed its delay ({parts[1]})")
    return LinkSpec(rate_bps=rate, delay_s=delay, jitter_s=jitter)


def parse_links(text: str, count: int) -> list[LinkSpec]:
    """``count`` links from one spec (every unit the same) or ``count`` comma-separated ones.

    Raises:
        ValueError: a spec is malformed, or the number of specs is neither 1 nor ``count``.
    """
    specs = [parse_link(part) for part in text.split(",")]
    if len(specs) == 1:
        return specs * count
    if len(specs) != count:
        raise ValueError(f"expected 1 or {count} comma-separated links, got {len(specs)}")
    return specs


def parse_outage(text: str) -> Outage:
    """An :class:`Outage` from ``START+DURATION[:MODE]``.

    Raises:
        ValueError: the text does not describe an outage.
    """
    body, _, mode = text.strip().partition(":")
    start, plus, duration = body.partition("+")
    if not plus or mode not in ("", "stall", "cut"):
        raise ValueError(f"expected an outage like 30s+5s or 30s+5s:cut, got {text!r}")
    return Outage(
        start_s=parse_duration(start),
        duration_s=parse_duration(duration),
        mode="cut" if mode == "cut" else "stall",
    )


def parse_outages(text: str) -> list[Outage]:
    """Comma-separated outages (empty text: none), sorted by start.

    Raises:
        ValueError: one is malformed, or two overlap.
    """
    outages = sorted(
        (parse_outage(part) for part in text.split(",") if part.strip()),
        key=lambda outage: outage.start_s,
    )
    for before, after in zip(outages, outages[1:], strict=False):
        if after.start_s < before.start_s + before.duration_s:
            raise ValueError(f"outages {before.text()} and {after.text()} overlap")
    return outages
