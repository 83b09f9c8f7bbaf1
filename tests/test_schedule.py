"""The pipeline schedule as data: builders, validator, grid (no MPI)."""

from dataclasses import FrozenInstanceError

import pytest

from ratrain.lifecycle.grid import grid
from ratrain.lifecycle.schedule import (
    Backward,
    Forward,
    RecvBackward,
    RecvForward,
    SendBackward,
    SendForward,
    SyncGrad,
    add_hooks,
    expand,
    gpipe,
    one_f_one_b,
)
from ratrain.lifecycle.validate import ScheduleError, check_pipeline, simulate

LAYOUTS = [(p, m) for p in range(1, 5) for m in range(1, 9)]


def compute(actions):
    return [a for a in actions if isinstance(a, (Forward, Backward))]


@pytest.mark.parametrize("builder", [one_f_one_b, gpipe])
@pytest.mark.parametrize("pp,m", LAYOUTS)
def test_builders_valid_and_deadlock_free(builder, pp, m):
    lists = [builder(pp, s, m) for s in range(pp)]
    check_pipeline(lists, m)
    simulate(lists)  # rendezvous sends: raises on deadlock


@pytest.mark.parametrize("pp,m", LAYOUTS)
def test_one_f_one_b_warmup_and_in_flight(pp, m):
    for s in range(pp):
        c = compute(one_f_one_b(pp, s, m))
        first_b = next(i for i, a in enumerate(c) if isinstance(a, Backward))
        assert first_b == min(pp - s - 1, m) + (1 if m > pp - s - 1 else 0)
        live = peak = 0
        for a in c:
            live += 1 if isinstance(a, Forward) else -1
            peak = max(peak, live)
        assert peak == min(pp - s, m)  # 1F1B's activation bound; GPipe holds m
        assert [a.mb for a in c if isinstance(a, Backward)] == list(range(m))


def test_pipeline_ends_have_no_messages():
    assert not any(isinstance(a, (RecvForward, SendBackward)) for a in one_f_one_b(3, 0, 4))
    assert not any(isinstance(a, (SendForward, RecvBackward)) for a in one_f_one_b(3, 2, 4))
    assert one_f_one_b(1, 0, 2) == (Forward(0), Backward(0), Forward(1), Backward(1))


def test_actions_are_frozen_and_hashable():
    a = Forward(3)
    with pytest.raises(FrozenInstanceError):
        a.mb = 4
    assert {a, Forward(3)} == {a}
    assert a.name() == "F mb3" and str(Backward(0)) == "B mb0"


def test_validator_catches_backward_before_forward():
    lists = [[Backward(0), Forward(0)]]
    with pytest.raises(ScheduleError, match="before Forward"):
        check_pipeline(lists, 1)


def test_validator_catches_missing_micro_batch():
    with pytest.raises(ScheduleError, match="no Backward"):
        check_pipeline([[Forward(0), Forward(1), Backward(0)]], 2)


def test_validator_catches_rendezvous_deadlock():
    # the naive steady state (send backward before receiving the next forward) deadlocks
    s0 = [Forward(0), SendForward(0), Forward(1), SendForward(1), RecvBackward(0), Backward(0),
          RecvBackward(1), Backward(1)]
    s1 = [RecvForward(0), Forward(0), Backward(0), SendBackward(0), RecvForward(1), Forward(1),
          Backward(1), SendBackward(1)]
    check_pipeline([s0, s1], 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([s0, s1])


def test_validator_catches_out_of_order_messages():
    s0 = [Forward(0), Forward(1), SendForward(1), SendForward(0), Backward(0), Backward(1)]
    s1 = [RecvForward(0), Forward(0), RecvForward(1), Forward(1), Backward(0), Backward(1)]
    with pytest.raises(ScheduleError, match="must match in order"):
        simulate([s0, s1])


def test_hooks_expand_around_blocks():
    blocks = ("embed", "layers.0")
    b = add_hooks([Backward(0)], bwd_post={0: [("layers.0", SyncGrad(("layers.0",)))]})[0]
    events = expand(b, blocks)
    assert [(blk, type(e).__name__) for blk, e in events] == [
        ("layers.0", "Backward"), (None, "SyncGrad"), ("embed", "Backward")]
    with pytest.raises(ValueError, match="does not hold"):
        expand(add_hooks([Forward(0)], fwd_pre={0: [("head", SyncGrad(("head",)))]})[0], blocks)


def test_grid_shows_the_schedule():
    text = grid([one_f_one_b(2, s, 3) for s in range(2)])
    rows = text.splitlines()[2:]
    assert rows[0].split("|")[1].strip() == "F mb0"  # stage 1 waits for its first activation
    assert rows[0].split("|")[2].strip() == ""
    assert rows[1].split("|")[2].strip() == "F mb0"
    assert "B mb2" in rows[-1]
