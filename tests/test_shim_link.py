"""The link model and throttle (virtual clock), and compute pacing, without MPI."""

import pytest

from ratrain.config import PlatformConfig
from ratrain.shim.link import Link
from ratrain.shim.pacing import Pacer
from ratrain.shim.platform import resolve_platform


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def send(link, nbytes, clock):
    """Release times of a message's chunks, advancing the clock as the sender sleeps."""
    end, out = None, []
    for lo, hi in link.chunks(nbytes):
        end = link.reserve(hi - lo, after=end)
        clock.t = max(clock.t, end)
        out.append(end)
    return out


def test_isolated_message_costs_latency_plus_bytes_over_bandwidth():
    clk = FakeClock()
    link = Link(1e9, 20e-6, chunk_bytes=1 << 20, clock=clk)
    n = 4 << 20
    assert send(link, n, clk)[-1] == pytest.approx(20e-6 + n / 1e9)
    assert link.message_time(n) == pytest.approx(20e-6 + n / 1e9)
    clk.t = 1.0
    assert send(link, 0, clk) == [pytest.approx(1.0 + 20e-6)]  # empty message: latency only


def test_streaming_pays_latency_once_and_time_scale_multiplies():
    clk = FakeClock()
    link = Link(1e9, 20e-6, time_scale=3.0, clock=clk)
    n, window = 1 << 20, 64
    ends = []
    for _ in range(window):  # back to back: each message reserved while the link is busy
        end = None
        for lo, hi in link.chunks(n):
            end = link.reserve(hi - lo, after=end)
        ends.append(end)
    assert ends[-1] == pytest.approx(3.0 * (20e-6 + window * n / 1e9))
    assert link.messages == window and link.bytes_sent == window * n


def test_a_late_wakeup_delays_no_later_chunk():
    """Slots are deadlines on the link's own timeline: a sender that wakes 70 us late after every
    chunk still has each chunk released at latency + (i + 1) chunks / bandwidth, so sleep
    overshoot never accumulates."""
    clk = FakeClock()
    c = 1 << 20
    link = Link(1e9, 20e-6, chunk_bytes=c, clock=clk)
    end, ends = None, []
    for lo, hi in link.chunks(16 * c):
        end = link.reserve(hi - lo, after=end)
        clk.t = end + 70e-6  # the sender wakes late and hands the chunk to MPI then
        ends.append(end)
    assert ends == pytest.approx([20e-6 + (i + 1) * c / 1e9 for i in range(16)])
    # a message posted at t0 pays its latency from t0, even if the first reserve comes later
    clk.t = 1.0
    assert link.reserve(c, t0=0.9995) == pytest.approx(0.9995 + 20e-6 + c / 1e9)


def test_concurrent_messages_share_the_bandwidth_fairly():
    clk = FakeClock()
    c = 1 << 16
    link = Link(1e9, 0.0, chunk_bytes=c, clock=clk)
    a_end = b_end = None
    a_times, b_times = [], []
    for _ in range(8):  # two senders reserve one chunk each in turn (as the engine interleaves)
        a_end = link.reserve(c, a_end)
        b_end = link.reserve(c, b_end)
        a_times.append(a_end)
        b_times.append(b_end)
    # both finish near 2x the time of one message alone: each got half the bandwidth
    assert a_times[-1] == pytest.approx(15 * c / 1e9)
    assert b_times[-1] == pytest.approx(16 * c / 1e9)


def test_chunks_cover_the_message():
    link = Link(1e9, chunk_bytes=1024)
    assert link.chunks(2500) == [(0, 1024), (1024, 2048), (2048, 2500)]
    assert link.chunks(0) == [(0, 0)]
    with pytest.raises(ValueError):
        Link(0)


def test_link_from_profile_only_when_emulating():
    assert Link.from_profile(resolve_platform(PlatformConfig(profile="mt3000"))) is None
    assert Link.from_profile(resolve_platform(PlatformConfig(profile="host", emulate=True))) is None
    link = Link.from_profile(resolve_platform(
        PlatformConfig(profile="mt3000", emulate=True, link_bandwidth=1e9, link_latency=2e-5, time_scale=10)))
    assert link.bandwidth == 1e9 and link.latency == 2e-5 and link.time_scale == 10
    assert link.message_time(1e6) == pytest.approx(10 * (2e-5 + 1e-3))


def test_pacer_pads_to_flops_over_rate_times_scale():
    slept = []
    prof = resolve_platform(PlatformConfig(profile="mt3000", emulate=True, compute_flops=1e9, time_scale=2.0))
    pacer = Pacer(prof, sleep=slept.append)
    assert pacer.target(1e6) == pytest.approx(2e-3)
    assert pacer.pace(1e6, elapsed=0.5e-3) == pytest.approx(1.5e-3)
    assert slept == [pytest.approx(1.5e-3)]
    assert pacer.pace(1e6, elapsed=5e-3) == 0.0 and pacer.overruns == 1
    with pacer.compute(0):
        pass


def test_pacer_is_off_unless_emulating():
    slept = []
    pacer = Pacer(resolve_platform(PlatformConfig(profile="mt3000")), sleep=slept.append)
    assert not pacer.enabled and pacer.pace(1e12, 0.0) == 0.0 and slept == []
    with pacer.compute(1e12):
        pass
    assert slept == []


def test_automatic_chunk_is_about_a_millisecond_of_wire_between_256k_and_1m():
    from ratrain.shim.link import auto_chunk_bytes

    assert auto_chunk_bytes(1e9) == 1 << 20  # 1 GB/s: ~1 ms = 1 MiB, a power of two
    assert auto_chunk_bytes(5e8) == 1 << 19
    assert auto_chunk_bytes(1e8) == 256 * 1024  # slow links keep fine-grained sharing
    assert auto_chunk_bytes(6.25e9, time_scale=2400) == 256 * 1024  # the lifecycle job's link
    assert auto_chunk_bytes(1e12) == 1 << 20
    assert Link(1e9).chunk_bytes == 1 << 20
    assert Link(1e9, chunk_bytes=4096).chunk_bytes == 4096
