"""Process-wide set-up of the services (shared/runtime.py)."""

from __future__ import annotations

import gc

from shared.runtime import freeze_startup_heap


def test_objects_alive_at_the_freeze_are_left_out_of_collections():
    probe = [object()]
    freeze_startup_heap()
    try:
        assert gc.get_freeze_count() > 0
        assert not any(o is probe for o in gc.get_objects())
        later = [object()]
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
