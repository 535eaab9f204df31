"""The rejection of an upload, raised wherever the outer judges one (validation, the norm guard,
the core) and counted by its reason."""

from __future__ import annotations


class Rejected(Exception):
    """An upload that is not applied; ``reason`` is the counter it is recorded under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
