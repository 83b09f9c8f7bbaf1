"""The memory tier in the simulator: each node's tier as a link.

The offload pass turns its actions into the simulator's items (`tier`, `tierwait`: the pass's
`TierItems`, `lifecycle.passes.offload`). `TierSim` plays them in `events.Sim`. Each node has
one tier (`rates.tier_bandwidth`), shared by the flows of its ranks (processor sharing, as an
interface); the same transfer of the other replicas of a group on that node rides along
(`copies`). A transfer costs `tier_latency`, then its bytes. A rank blocked on a wait accounts
the time as the tier's exposed time (`RankStats.tier_exposed_s`), every transfer's duration as
its tier time (`tier_s`) and its bytes as its traffic (`tier_bytes`).
"""

from __future__ import annotations

import math


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


__all__ = ["TierSim"]
