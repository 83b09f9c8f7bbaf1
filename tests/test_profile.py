"""`exec.profile.Profile`: time per category, a nested category's time counted only in the
innermost, and `sync=` (a device's synchronize) called around every timed call."""

from __future__ import annotations

import pytest

from ratrain.exec.profile import Profile, timed


@timed("inner")
def inner():
    return 1


@timed("outer")
def outer():
    return inner() + inner()


def test_nested_calls_count_in_the_innermost_and_sync_wraps_each_call():
    syncs = []
    with Profile(sync=lambda: syncs.append(1)) as prof:
        assert outer() == 2
    assert prof.calls == {"outer": 1, "inner": 2}
    assert len(syncs) == 2 * 3  # before and after each of the three timed calls
    assert prof.seconds["outer"] >= 0 and prof.seconds["inner"] >= 0
    assert outer() == 2 and prof.calls["outer"] == 1  # off once the block ends
    with pytest.raises(RuntimeError, match="already running"), Profile(), Profile():
        pass
