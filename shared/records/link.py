"""What a shaped link writes: :class:`LinkStatus` in KV ``diloco_status``, ``J.link.<u>`` or
``J.link.outer`` (``diloco link``), read by the gateway and ``diloco up``."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import (
    Field,
    NonNegativeFloat,
)

from shared.link_spec import LinkSpec, OutageMode
from shared.records import (
    Count,
    Record,
)

#: A link's name: the index of the unit it carries, or ``outer``.
LINK_NAME_PATTERN = re.compile(r"^(outer|[0-9]{1,2})$")


class LinkStatus(Record):
    """What has crossed one shaped link since its ``diloco link`` process started (every
    ``--report-every-s``). "Up" is towards nats-server, "down" towards the client."""

    name: Annotated[str, Field(pattern=LINK_NAME_PATTERN.pattern)]
    spec: LinkSpec
    bytes_up: Count = 0
    bytes_down: Count = 0
    busy_up_s: NonNegativeFloat = Field(0.0, description="seconds the up line was busy")
    busy_down_s: NonNegativeFloat = Field(0.0, description="seconds the down line was busy")
    uptime_s: NonNegativeFloat = 0.0
    connections: Count = Field(0, description="connections open now")
    connects: Count = Field(0, description="connections accepted in all")
    outage: OutageMode | None = Field(None, description="the outage in progress")
    outages: Count = Field(0, description="outages begun so far")

    @property
    def unit(self) -> int | None:
        """The unit the link carries (None: the outer's link)."""
        return None if self.name == "outer" else int(self.name)

    def utilisation(self) -> tuple[float, float] | None:
        """Share of its lifetime each direction (up, down) was busy (None: no rate cap)."""
        if self.spec.rate_bps is None or self.uptime_s <= 0:
            return None
        return self.busy_up_s / self.uptime_s, self.busy_down_s / self.uptime_s
