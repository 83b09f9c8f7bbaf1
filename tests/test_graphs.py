"""Device graphs (`run.graphs`, `exec.graphs`, `device.graphs`): the stand-in's capture records a
call's device operations and replays them on the same memory, refusing what a capturing stream
refuses; a decoder layer's calls replayed train bitwise as eager ones, in fp16 and bf16, every
recompute choice, in fewer host launches."""

from dataclasses import replace

import numpy as np
import pytest

from ratrain.device import graphs as dgraphs
from ratrain.device import open_device
from ratrain.device.standin import COUNTS, CaptureError, standin
from ratrain.device.standin_graphs import capture
from ratrain.exec import graphs
from ratrain.exec.backends import kernel_table
from ratrain.exec.context import ExecContext
from ratrain.runtime.rank import build_rank
from tests._executor_util import MODEL, global_batch, tiny_config

xp = standin


def test_a_replay_runs_the_captured_operations_again_on_the_same_memory():
    a = xp.asarray(np.arange(6, dtype=np.float32))
    acc = xp.zeros(6, np.float32)

    def call():
        b = a * 2.0  # made under capture: the graph's from now on
        acc[...] += b
        return xp.exp(b[::2]).sum()

    COUNTS.clear()
    graph, s = capture(call)
    assert COUNTS["ops"] == 1 and COUNTS["graphs"] == 1  # captured, then launched once
    assert graph.ops == COUNTS["graph_ops"] == 4  # multiply, add (in place), exp, sum
    assert float(s) == pytest.approx(np.exp(np.arange(0, 12, 4)).sum())
    a[...] = xp.asarray(np.ones(6, np.float32))  # new values at the captured address
    COUNTS.clear()
    graph.launch()
    assert COUNTS["ops"] == 1 and COUNTS["graph_ops"] == 4
    assert float(s) == pytest.approx(3 * np.exp(2.0))  # the result array, refilled
    np.testing.assert_array_equal(acc.get(), 2 * np.arange(6) + 2)  # added into again


@pytest.mark.parametrize("what, call", [
    ("a host sync", lambda a: float(a.sum())),
    (r"a download \(a host sync\)", lambda a: a.get()),
    ("a host sync", lambda a: a.sum().item()),
    ("an upload from host memory", lambda a: a + xp.asarray(np.ones(3, np.float32))),
    (r"cuBLAS through cupy \(matmul\)", lambda a: xp.matmul(a[:, None], a[None])),
    (r"cuBLAS through cupy \(matmul\)", lambda a: a[:, None] @ a[None]),
    (r"cuBLAS through cupy \(dot\)", lambda a: xp.dot(a, a)),
])
def test_capture_refuses_what_a_capturing_stream_refuses(what, call):
    a = xp.asarray(np.ones(3, np.float32))
    with pytest.raises(CaptureError, match=f"^{what} while a stream captures a graph: cupy "
                       "refuses it"):
        capture(lambda: call(a))
    float(a.sum())  # not capturing any more


def test_a_replay_that_would_differ_from_its_capture_is_refused():
    """A card replays what it captured: the host scalars and the addresses then. The stand-in
    runs the call again on a replay and refuses it where it differs: a changed scalar, an array
    elsewhere, another sequence of operations."""
    held = {"scale": 2.0, "x": xp.asarray(np.ones(4, np.float32)), "more": False}

    def call():
        y = held["x"] * held["scale"]
        if held["more"]:
            y += 1.0
        return y

    graph, y = capture(call)
    held["scale"] = 3.0  # frozen into the capture
    with pytest.raises(CaptureError, match=r"^a replay of a graph differs from its capture at "
                       r"operation 0 \(multiply\): captured 2.0, now 3.0; a graph replays"):
        graph.launch()
    held["scale"], held["x"] = 2.0, xp.asarray(np.ones(4, np.float32))  # another address
    with pytest.raises(CaptureError, match=r"operation 0 \(multiply\): an array captured at "
                       r"0x[0-9a-f]+, now at 0x[0-9a-f]+; a graph"):
        graph.launch()
    graph2, y2 = capture(call)
    held["more"] = True
    with pytest.raises(CaptureError, match=r"at operation 1 \(add\): captured '\(the capture "
                       r"ended\)'|ran 2 operations, its capture 1"):
        graph2.launch()


def test_capture_is_refused_inside_a_capture_and_on_the_host():
    with pytest.raises(CaptureError, match="a capture or a launch inside a capture"):
        capture(lambda: capture(lambda: None))
    assert dgraphs.why_not(standin) == ""
    with pytest.raises(CaptureError, match="^capture on cpu: the host"):
        dgraphs.capture(np, lambda: None)


def _ctx(precision, attention="cudnn-count"):
    return ExecContext(MODEL, precision, standin,
                       kernels=kernel_table(standin, precision, attention=attention,
                                            devkernels_mode="count"))


def test_graphs_resolve_where_every_op_of_a_layer_call_captures():
    assert graphs.resolve("auto", _ctx("bf16")) and graphs.resolve("on", _ctx("fp16"))
    assert not graphs.resolve("off", _ctx("bf16"))
    for ctx, why in ((_ctx("fp32", "tiled-1024"), "precision=fp32: a device's fp32 GEMMs"),
                     (_ctx("bf16", "tiled-1024"), "run.attention=tiled-1024 runs its GEMMs "
                                                  "through cupy's cuBLAS")):
        assert not graphs.resolve("auto", ctx)
        with pytest.raises(ValueError, match=f"^run.graphs=on: {why}.*; set run.graphs=auto"):
            graphs.resolve("on", ctx)
    assert not graphs.resolve("auto", _ctx("bf16"), parks=True)
    with pytest.raises(ValueError, match="^run.graphs=on: offload.activations moves a cache's "
                       r"arrays .* \(set offload.activations=off\); set run.graphs=auto"):
        graphs.resolve("on", _ctx("bf16"), parks=True)
    host = ExecContext(MODEL, "bf16", np)
    with pytest.raises(ValueError, match="^run.graphs=on: the host .* a graph is a device's"):
        graphs.resolve("on", host)


def _run(precision, mode, steps=6, recompute="none", pp=1, m=3):
    cfg = tiny_config(precision=precision, recompute=recompute, steps=steps, m=m)
    cfg = replace(cfg, run=replace(cfg.run, devkernels="count", attention="cudnn-count",
                                   graphs=mode))
    rank = build_rank(cfg, None, cap=None, device=open_device("standin"))
    per_step = []
    try:
        for s in range(steps):
            COUNTS.clear()
            r = rank.executor.run_step(s, global_batch(cfg, s))
            per_step.append(((r.loss, r.grad_norm, r.skipped), dict(COUNTS)))
        rank.executor.flush()
        bg = rank.executor.compute.graphs
        return per_step, rank.executor.full_params(), bg
    finally:
        rank.close()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_replayed_layers_train_bitwise_as_eager_ones(precision, recompute):
    eager, eager_params, none = _run(precision, "off", recompute=recompute)
    replayed, params, bg = _run(precision, "on", recompute=recompute)
    assert none is None and bg is not None
    assert [r for r, _ in replayed] == [r for r, _ in eager]
    for name, w in eager_params.items():
        np.testing.assert_array_equal(params[name], w, err_msg=name)
    # each layer's forward and backward, the head's and the embedding's backward captured,
    # again where an input came from an eager call then and from a graph later, then replayed
    graphed, m = 2 * MODEL.layers + 3, 3
    assert [c.get("captures", 0) for _, c in replayed[-2:]] == [0, 0]
    assert graphed <= bg.captures <= 3 * graphed
    (_, first), (_, last) = eager[-1], replayed[-1]
    assert last["graphs"] == graphed * m  # every such call a replay
    assert last["ops"] < first["ops"] // 4, (last, first)  # the host launches
    # a replay runs what the eager call ran, plus the copies a micro-batch: into a graph's
    # input (the first layer's x, the head's targets, the embedding's ids) and out of one (the
    # loss the executor keeps)
    assert last["ops"] - last["graphs"] + last["graph_ops"] == first["ops"] + 4 * m
    assert last["syncs"] == first["syncs"] == 1


def test_views_and_gradients_keep_their_addresses_for_the_graphs():
    steps, _, _ = _run("bf16", "on", steps=8)
    # none after the chain settles: the views and gradients stayed where they were
    assert [c.get("captures", 0) for _, c in steps[4:]] == [0] * 4
