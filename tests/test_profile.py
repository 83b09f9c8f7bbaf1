"""`exec.profile.Profile`: time per category, a nested category's time counted only in the
innermost, `sync=` (a device's synchronize) called around every timed call, and a `counter=`
shared out by category the same way."""

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


def test_a_counter_is_shared_out_by_category_nested_calls_subtracted():
    n = [0]

    @timed("leaf")
    def leaf():
        n[0] += 2

    @timed("branch")
    def branch():
        n[0] += 1
        leaf()
        leaf()

    with Profile(counter=lambda: n[0]) as prof:
        branch()
        n[0] += 7  # outside every category
    assert prof.counts == {"branch": 1, "leaf": 4}
    rows = {r["category"]: r for r in prof.rows()}
    assert rows["leaf"]["count"] == 4 and rows["branch"]["count"] == 1
    with Profile() as prof:
        branch()
    assert all("count" not in r for r in prof.rows())
