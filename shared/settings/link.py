"""The shaped link every learner reaches NATS through (``diloco link``; docs/NETWORK.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.link_spec import LinkSpec, parse_link


class ShapedLinkSettings(BaseModel):
    """One shaped link per learner, all of one shape."""

    model_config = ConfigDict(extra="forbid")

    link: str = Field(
        "",
        description="every learner reaches NATS through its own shaped link of this shape, "
        "RATE[/DELAY[/JITTER]], e.g. 100mbit/25ms (diloco link; its bytes show in /metrics as "
        "diloco_link_bytes); default: no link",
    )

    @field_validator("link")
    @classmethod
    def _check_link(cls, value: str) -> str:
        if value:
            parse_link(value)  # a clear error at start
        return value

    def link_spec(self) -> LinkSpec | None:
        """Every learner's link (None: the learners reach NATS directly)."""
        return parse_link(self.link) if self.link else None
