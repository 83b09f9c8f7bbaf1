"""The memory tier in the simulator: its transfers as items, and the node's tier as a link.

`TierItems` gives `events._Flatten` its handlers of the tier's actions (`lifecycle.offload`
places them): a transfer item (`tier`: bytes out or in) for `Offload` / `Fetch`, a wait item
(`tierwait`) for `WaitOffload` / `WaitFetch`; a read-only master dropped moves nothing. Bytes:
a layer's saved activations as the memory model counts them (`CostModel.offload_bytes`), a
block's optimizer state in the tier (`lifecycle.offload.STATE_TIER_BYTES` per parameter of its
segment), a master 4 per parameter.

`TierSim` plays them in `events.Sim`: each node has one tier (`rates.tier_bandwidth`, shared by
the flows of its ranks, processor sharing as an interface; the same transfer of the other
replicas of a group on that node rides along, `copies`), a transfer costs `tier_latency` then
its bytes; a rank blocked on a wait accounts the time as the tier's exposed time
(`RankStats.tier_exposed_s`), every transfer's duration as its tier time (`tier_s`) and its
bytes as its traffic (`tier_bytes`).
"""

from __future__ import annotations

import math

from ratrain.exec.params import shard_size
from ratrain.exec.spec import block_role
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.offload import STATE_TIER_BYTES


class TierItems:
    """The tier's actions of one rank's step as `events._Item`s (see the module)."""

    def __init__(self, flat, item, offload_state: str = "off"):
        self.flat, self.item, self.mode = flat, item, offload_state

    def handlers(self) -> dict:
        return {sched.Offload: self._move, sched.Fetch: self._move,
                sched.WaitOffload: self._wait, sched.WaitFetch: self._wait}

    def _key(self, a):
        return (self.flat.step, a.what, a.block, a.mb)

    def _bytes(self, a) -> float:
        fig, role = self.flat.figure, block_role(a.block)
        if a.what == "act":
            return fig("offload_bytes", role)
        n = shard_size(fig("block_params", role), self.flat.shards)
        return (STATE_TIER_BYTES[self.mode] if a.what == "state" else 4) * n

    def _move(self, a):
        if isinstance(a, sched.Offload) and a.what == "master":
            return  # a read-only copy, dropped: nothing moves
        self.flat.out.append(self.item("tier", step=self.flat.step, act=a,
                                       key=self._key(a), nbytes=self._bytes(a)))

    def _wait(self, a):
        self.flat.out.append(self.item("tierwait", step=self.flat.step, act=a,
                                       key=self._key(a)))


class TierSim:
    """The nodes' tiers in `events.Sim` (see the module)."""

    def __init__(self, sim, link):
        self.sim, self.link = sim, link
        self.links = {}  # node -> its tier (made at the node's first transfer)
        self.done: dict[tuple, float] = {}  # (rank, key) -> time the transfer ended

    def start(self, t, r, rk, it) -> bool:
        rates, node = self.sim.costs[r].rates, self.sim.node[r]
        if node not in self.links:
            self.links[node] = self.link(self.sim, rates.tier_bandwidth or math.inf)
        nbytes = it.nbytes * self.sim.copies[r]
        key, step = (r, it.key), it.step
        rk.tier_bytes[step] = rk.tier_bytes.get(step, 0.0) + it.nbytes

        def on_wire(t2):
            self.links[node].add(t2, nbytes, on_done)

        def on_done(t3):
            self.done[key] = t3
            rk.tier_s[step] = rk.tier_s.get(step, 0.0) + t3 - t
            self.sim.wake(("tier",) + key)

        self.sim.at(t + (rates.tier_latency or 0.0), on_wire)
        return True

    def wait(self, t, r, rk, it) -> bool:
        key = (r, it.key)
        if key not in self.done:
            self.sim._block(rk, t, ("tier",) + key, r)
            return False
        t0 = rk.blocked_since if rk.blocked_since is not None else t
        rk.tier_exposed[it.step] = rk.tier_exposed.get(it.step, 0.0) + (t - t0)
        rk.blocked_since = None
        del self.done[key]
        return True


__all__ = ["TierItems", "TierSim"]
