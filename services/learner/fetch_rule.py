"""Which global versions a unit wants (``--params-fetch``): a pure rule, which the params fetcher
runs on the heads it sees and the quality simulator (``sim/training.py``) on the versions the
outer publishes.

* ``newest``: every version newer than the one the unit holds (over a slow link the fetcher
  skips those published while a copy crosses it; the rule wants them all).
* ``after_upload``: each fragment once at start, then once after each upload of it that
  JetStream accepted: the first version published after that moment.
"""

from __future__ import annotations

from shared.settings.algorithm import ParamsFetchName


class FetchRule:
    """Per fragment, the version above which the next wanted one lies (None: none wanted)."""

    def __init__(self, policy: ParamsFetchName, fragments: int) -> None:
        self.policy = policy
        self._wanted: list[int | None] = [-1] * fragments

    def wanted(self, fragment: int) -> int | None:
        """A version above this one is wanted (None: none is, until the next upload)."""
        return self._wanted[fragment]

    def wants(self, fragment: int, version: int) -> bool:
        """Whether ``version`` of ``fragment`` is one to fetch."""
        wanted = self._wanted[fragment]
        return wanted is not None and version > wanted

    def uploaded(self, fragment: int, newest_version: int) -> None:
        """An upload of ``fragment`` was accepted while ``newest_version`` was the newest
        published: with ``after_upload``, the first version after it is wanted."""
        if self.policy == "after_upload":
            self._wanted[fragment] = newest_version

    def fetched(self, fragment: int, wanted: int | None) -> None:
        """A version was fetched for the want ``wanted`` (what :meth:`wanted` said when the
        fetch began): with ``after_upload`` the want is met, unless an upload asked for a
        newer version meanwhile."""
        if self.policy == "after_upload" and self._wanted[fragment] == wanted:
            self._wanted[fragment] = None
