"""A NATS user's credentials file (``shared.nats_auth``): :class:`NatsCredentials`, written by
``diloco up`` (or a compose cluster's broker and controller), read by the service it names."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from shared.records import (
    Count,
    Record,
)

NatsRole = Literal["admin", "outer", "gateway", "learner", "link"]

NATS_USER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"


class NatsCredentials(Record):
    """A credentials file (``shared.nats_auth``): the NATS user a service connects as.

    Written, readable by its owner only, by ``diloco up`` (or, in a compose cluster, by the
    broker and the controller); read by the service it names (``--nats-credentials`` or
    ``DILOCO_NATS_CREDENTIALS``) and by whoever builds the server's configuration, which holds
    only the password's bcrypt hash. The role, job, unit and link name the identity, so the
    user's permissions can be rebuilt from the file alone.
    """

    user: str = Field(pattern=NATS_USER_PATTERN)
    password: str = Field(min_length=16, max_length=256)
    role: NatsRole
    job: str = Field("", max_length=128, description="the job an outer, learner or link acts for")
    unit: Count | None = Field(None, description="a learner's unit")
    link: str = Field("", max_length=64, description="a link's name")
