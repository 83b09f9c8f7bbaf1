"""The DDR ledger: accounting equals the arrays' real bytes; the cap error says everything."""

import threading

import numpy as np
import pytest

from ratrain.shim.ledger import DDRCapExceeded, Ledger


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.uint8])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 11), (0,)])
def test_alloc_accounts_exactly_nbytes(dtype, shape):
    led = Ledger()
    a = led.alloc("params.master", shape, dtype)
    assert a.shape == shape and a.dtype == dtype
    assert led.current == a.nbytes == led.in_use("params.master")
    led.free(a)
    assert led.current == 0 and led.by_tag() == {}


def test_track_free_views_and_peaks():
    led = Ledger()
    big = led.alloc("grads.layers.0", (1000,), np.float32)
    acts = [np.ones((17, 3), np.float16), np.ones(5, np.float64)]
    assert led.track("activations.mb0.layers.0", *acts, big[:10], None) == sum(a.nbytes for a in acts)
    assert led.current == big.nbytes + sum(a.nbytes for a in acts)
    assert led.in_use(prefix="activations.") == sum(a.nbytes for a in acts)
    peak = led.peak
    led.release(*acts)
    assert led.current == big.nbytes and led.peak == peak
    assert led.peak_by_tag()["activations.mb0.layers.0"] == sum(a.nbytes for a in acts)
    led.reset_peak()
    assert led.peak == big.nbytes
    assert led.free_tag("grads.layers.0") == big.nbytes and led.current == 0


def test_cap_error_names_rank_tag_bytes_in_use_cap_and_largest_users():
    led = Ledger(cap=10_000, rank=3)
    for i, n in enumerate([3000, 2000, 1000, 900, 800, 700]):
        led.reserve(f"user{i}", n)
    in_use = led.current
    with pytest.raises(DDRCapExceeded) as e:
        led.alloc("activations.mb3.layers.5", (1000,), np.float32)
    msg = str(e.value)
    assert "rank 3" in msg and "'activations.mb3.layers.5'" in msg and "(4000 B)" in msg
    assert f"in use 8.20 KiB ({in_use} B)" in msg and "cap 9.77 KiB (10000 B)" in msg
    for i in range(5):
        assert f"user{i}=" in msg
    assert "user5=" not in msg  # only the five largest
    assert led.current == in_use  # nothing accounted for the failed allocation
    led.alloc("fits", (100,), np.float32)  # exactly up to the cap is fine
    assert led.current == in_use + 400


def test_double_free_is_an_error():
    led = Ledger()
    led.reserve("comm.ring", 10)
    with pytest.raises(ValueError, match="double free"):
        led.unreserve("comm.ring", 11)


def test_thread_safe_accounting():
    led = Ledger(cap=None)

    def work():
        for _ in range(200):
            a = led.alloc("scratch.gemm", (64,), np.float32)
            led.free(a)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert led.current == 0 and led.peak <= 4 * 256
