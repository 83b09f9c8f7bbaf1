"""The executor's timeline: packed, the current step only without run.trace (flat over steps),
bounded in bytes and counted by the ledger with it; the trainer reports each rank's resident
set beside its ledger peak."""

from __future__ import annotations

from ratrain.config import RunConfig
from ratrain.runtime.trace import CHUNK, EVENT, TAG, Timeline
from ratrain.shim.allocator import resident_bytes
from ratrain.shim.ledger import Ledger
from tests._executor_util import tiny_config, train


def _steps(tl: Timeline, steps, per_step: int) -> None:
    for s in steps:
        tl.new_step()
        for i in range(per_step):
            tl.add(f"F mb{i % 3}", "compute", s + i * 1e-3, s + i * 1e-3 + 5e-4, i % 2, s)


def test_without_trace_only_the_current_step_is_kept():
    tl = Timeline.for_run(RunConfig(trace=False))
    _steps(tl, range(3), 1500)  # more than a block per step
    size = tl.nbytes
    _steps(tl, range(3, 53), 1500)
    assert tl.nbytes == size == 2 * CHUNK * EVENT.itemsize  # reused, never grown
    events = tl.events()
    assert len(events) == len(tl) == 1500 and {e[5]["step"] for e in events} == {52}
    t0 = 52 + 1499 * 1e-3
    assert events[-1] == ("F mb2", "compute", t0, t0 + 5e-4, 1, {"step": 52})  # float64 kept
    assert tl.last() == "F mb2" and tl.dropped == 0


def test_with_trace_every_step_up_to_the_bound_counted_by_the_ledger():
    ledger = Ledger()
    bound = 5 * CHUNK * EVENT.itemsize
    tl = Timeline.for_run(RunConfig(trace=True, trace_bytes=bound), ledger)
    _steps(tl, range(10), 1000)
    assert tl.nbytes <= bound and ledger.in_use(TAG) == tl.nbytes
    assert len(tl) + tl.dropped == 10_000 and tl.dropped > 0
    steps = [e[5]["step"] for e in tl.events()]
    assert steps == sorted(steps) and steps[-1] == 9  # the newest kept, oldest first


def test_trainer_metrics_hold_each_ranks_memory(tmp_path):
    res, _state, ex = train(tiny_config(steps=2))
    assert len(res[-1].resident_bytes) == 1 and res[-1].resident_bytes[0] > 0
    assert res[-1].peaks_ddr_bytes == (res[-1].peak_ddr_bytes,)
    assert 0 < res[-1].resident_bytes[0] <= 2 * resident_bytes()
    assert len(ex.events) < 200  # the last step's (plus the flush's), not every step's


def test_names_and_groups_are_interned_apart():
    tl = Timeline()
    for i in range(300):  # more names than a group id could count
        tl.add(f"n{i}", "compute" if i % 2 else "comm", 0.0, 1.0, 0, 0)
    tl.add("late", "lifecycle", 0.0, 1.0, 0, 0)
    assert tl.events()[-1][:2] == ("late", "lifecycle") and tl.last() == "late"
