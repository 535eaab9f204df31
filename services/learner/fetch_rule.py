"""Which global versions a unit wants (``--params-fetch``): a pure rule, which the params fetcher
runs on the heads it sees and the quality simulator (``sim/training.py``) on the versions the
outer publishes.

* ``newest``: every version newer than the one the unit holds (over a slow link the fetcher
  skips those published while a copy crosses it; the rule wants them all).
* ``after_upload``: each fragment once at start, then once after each upload of it that
  JetStream accepted: the first version published after that moment.

With ``newest``, ``fetches_per_period`` F paces the fetches: a fragment's next fetch starts no
sooner than H/F of the unit's steps after its last one began (H: the unit's own sync period, as
DyLU sets it), so a unit takes at most about F versions per upload of the fragment, whatever
the number of units publishing. 0: no pacing.
"""

from __future__ import annotations

from shared.settings.algorithm import ParamsFetchName


class FetchRule:
    """Per fragment, the version above which the next wanted one lies (None: none wanted)."""

    def __init__(
        self,
        policy: ParamsFetchName,
        fragments: int,
        fetches_per_period: int = 0,
        h_steps: int = 1,
    ) -> None:
        """Args:
        policy: ``newest`` or ``after_upload``.
        fragments: the number of fragments.
        fetches_per_period: F (0: no pacing).
        h_steps: the unit's sync period until :meth:`at_step` tells another.
        """
        self.policy = policy
        self.fetches_per_period = fetches_per_period
        self._wanted: list[int | None] = [-1] * fragments
        self._step = 0
        self._h_steps = max(1, h_steps)
        self._next_step = [0] * fragments  # the step from which a fetch may start again

    def at_step(self, step: int, h_steps: int) -> bool:
        """The unit is at ``step`` with sync period ``h_steps``; returns whether a fragment's
        pause between fetches ended with it (so the fetcher looks again)."""
        opened = any(self._step < due <= step for due in self._next_step)
        self._step, self._h_steps = step, max(1, h_steps)
        return opened

    def due(self, fragment: int) -> bool:
        """Whether a fetch of ``fragment`` may start now (its pacing pause is over)."""
        return self._step >= self._next_step[fragment]

    def wanted(self, fragment: int) -> int | None:
        """A version above this one is wanted (None: none is, until the next upload)."""
        return self._wanted[fragment]

    def wants(self, fragment: int, version: int) -> bool:
        """Whether ``version`` of ``fragment`` is one to fetch."""
        wanted = self._wanted[fragment]
        return wanted is not None and version > wanted and self.due(fragment)

    def started(self, fragment: int) -> None:
        """A fetch of ``fragment`` starts now: with pacing, the next one waits H/F steps."""
        if self.policy == "newest" and self.fetches_per_period > 0:
            gap = max(1, self._h_steps // self.fetches_per_period)
            self._next_step[fragment] = self._step + gap

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
