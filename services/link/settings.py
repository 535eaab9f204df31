"""Settings of ``diloco link``, a shaped link in front of nats-server (flags
``diloco link --help``, env ``DILOCO_*``)."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator

from shared.link_spec import LinkSpec, Outage, parse_link, parse_outages
from shared.records.link import LINK_NAME_PATTERN
from shared.settings.nats import NatsSettings


class LinkSettings(NatsSettings):
    """A shaped TCP link: clients connect to ``--listen-port`` and reach the nats-server of
    ``--nats-url`` through it, at the rate, delay and jitter of ``--link``, with the outages of
    ``--outages``. Every ``--report-every-s`` the bytes that crossed it go to the status bucket
    (``J.link.<name>``), over a connection of its own that is not shaped."""

    job: str = Field("demo", description="job whose status bucket gets the link's counters")
    name: str = Field(
        "0", description="the link's name in its status record: the unit it carries, or outer"
    )
    link: str = Field(
        "unlimited", description="RATE[/DELAY[/JITTER]], e.g. 100mbit/25ms or 20mbit/50ms/5ms"
    )
    outages: str = Field(
        "",
        description="scheduled outages START+DURATION[:stall|cut], comma-separated, e.g. "
        "30s+5s,2m+10s:cut (START from the link's start)",
    )
    listen_host: str = Field("127.0.0.1", description="interface clients connect to")
    listen_port: int = Field(0, ge=0, le=65535, description="port clients connect to")
    report_every_s: float = Field(1.0, gt=0, description="seconds between status records")
    seed: int | None = Field(None, description="seed of the jitter (default: random)")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not LINK_NAME_PATTERN.match(value):
            raise ValueError(f"expected a unit index below 100 or 'outer', got {value!r}")
        return value

    @field_validator("link")
    @classmethod
    def _check_link(cls, value: str) -> str:
        parse_link(value)
        return value

    @field_validator("outages")
    @classmethod
    def _check_outages(cls, value: str) -> str:
        parse_outages(value)
        return value

    def link_spec(self) -> LinkSpec:
        """The link's shape."""
        return parse_link(self.link)

    def outage_schedule(self) -> list[Outage]:
        """The scheduled outages, by start."""
        return parse_outages(self.outages)

    def upstreams(self) -> list[tuple[str, int]]:
        """Host and port of every nats-server of ``--nats-url``: the link forwards to the
        first, and to the next while that one is unreachable."""
        return [
            (url.hostname or "127.0.0.1", url.port or 4222)
            for url in map(urlsplit, self.nats_servers())
        ]
