"""Offload's runner: the executor's handlers of `Offload`, `WaitOffload`, `Fetch` and `WaitFetch`
(the pass, which places them: `lifecycle.passes.offload`), over one rank's
`shim.tierstore.TierStore`.

    tier, external = open_tier(cfg, profile, rank, held)   # build_rank opens the rank's tier
    off = Offloader.of_executor(executor, p, tier)          # the executor makes its runner
    handlers = off.handlers()                  # merged into the executor's dispatch table
    off.prepare_activations(nbytes)            # the activations' file, sized for a step

Activations: `Offload(L, mb)` hands every array of layer L's cache for micro-batch mb to the
store's thread (a device rank downloads them there), which writes them into an extent of the
activations' file; `WaitOffload` waits, releases the arrays from the DDR ledger and leaves
parked records (shape, dtype, offset) in the cache. `Fetch(L, mb)` allocates the arrays again
from the ledger (`activations.mb<i>.<L>`: accounted from here, so the DDR peak with a transfer in
flight is what the memory model plays) and has the thread read them back; `WaitFetch` puts them
back in the cache and frees the extent. The layer's backward then runs as if they never left.

Optimizer state (`offload.optimizer`): the stage's `m`, `v` (and `master`) buffers are the
state file's memory-mapped arrays (`StageState(external=...)`), never in the DDR ledger; `Fetch
(b, what="state")` copies the block's segment into DDR buffers (ledger `optim.m`, ...) that the
state serves as the block's (`StageState.place`) until `WaitOffload` after the update has
written them back; `what="master"` fetches the master alone, read-only, for a view cast.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import numpy as np

from ratrain.config.offload import tier_dir
from ratrain.device import is_host, to_device, to_host
from ratrain.exec.layers import BlockCache
from ratrain.exec.params import BUFFER_TAGS
from ratrain.lifecycle.passes.offload import Fetch, Offload, WaitFetch, WaitOffload
from ratrain.lifecycle.recovery import TierRates
from ratrain.runtime.passes.base import Runner
from ratrain.shim.link import Slots
from ratrain.shim.tier import TierLedger, tier_link
from ratrain.shim.tierstore import TierError, TierStore

STATE_KINDS = {"moments": ("m", "v"), "masters": ("master", "m", "v")}


@dataclass
class Tier:
    """A rank's memory tier: its files (`store`) and what `offload.activations: auto` weighs
    (`rates`)."""

    store: TierStore
    rates: TierRates


def open_tier(cfg, profile, rank: int, held_size: int, shared=None):
    """This rank's tier when `offload.*` asks for one (else (None, {})): the store in
    `offload.path` (default `<run.dir>/tier`, made) accounted against the rank's share of the
    profile's tier (`platform.tier`), throttled under emulation (its slots `shared` by the
    node's ranks), and the state buffers that live there (`offload.optimizer`), as
    {buffer: memory-mapped fp32 array of `held_size`} for `StageState(external=...)`."""
    off = cfg.offload
    if not off.enabled:
        return None, {}
    if off.optimizer != "off" and cfg.run.device != "cpu":
        raise ValueError(f"offload.optimizer={off.optimizer} keeps the optimizer state in host "
                         f"memory-mapped files, which run.device={cfg.run.device} does not read "
                         "in place: set offload.optimizer=off there (activations may still go "
                         "to the tier)")
    spec, rpn = profile.tier, profile.ranks_per_node or 1
    path, key = tier_dir(cfg), "offload.path"
    made = not off.path and not os.path.isdir(path)
    if made:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise TierError.of(path, "run.dir", e) from None
    ledger = TierLedger(spec.rank_share(rpn) if spec is not None else None, rank, path, key,
                        spec.name if spec is not None else "tier")
    link = (tier_link(spec, profile.time_scale, shared if shared is not None else Slots())
            if profile.emulate else None)
    store = TierStore(path, rank, ledger, link, key, made=made)
    rates = TierRates.of_profile(profile)
    external = {}
    try:
        for k in STATE_KINDS.get(off.optimizer, ()):
            region = store.region("state", k, 4 * held_size)
            external[k] = region.view(np.float32)
    except BaseException:
        store.close()
        raise
    return Tier(store, rates), external


@dataclass(frozen=True)
class Parked:
    """An array of a cache while it is in the tier: where, and what it was."""

    shape: tuple
    dtype: np.dtype
    offset: int  # bytes into the extent


def _slots(cache: BlockCache):
    """Every (container, key) of an array the cache holds (its input first), once per array."""
    out, seen = [], set()

    def add(container, key):
        a = container[key] if isinstance(container, (dict, list)) else getattr(container, key)
        if hasattr(a, "nbytes") and hasattr(a, "shape") and id(a) not in seen:
            seen.add(id(a))
            out.append((container, key))

    add(cache, "x")
    for part in cache.parts or ():
        for k in list(part):
            add(part, k)
    for k in list(cache.extra):
        add(cache.extra, k)
    return out


def _get(container, key):
    return container[key] if isinstance(container, dict) else getattr(container, key)


def _put(container, key, value) -> None:
    if isinstance(container, dict):
        container[key] = value
    else:
        setattr(container, key, value)


def _bytes(a) -> np.ndarray:
    """A host array's bytes (flat uint8; contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class Offloader(Runner):
    """One rank's transfers to and from the tier (see the module)."""

    def __init__(self, tier: Tier, state, compute, ledger, xp, on_transfer=None,
                 state_mode="off"):
        self.store, self.rates = tier.store, tier.rates
        self.state, self.compute, self.ledger, self.xp = state, compute, ledger, xp
        self.host = is_host(xp)
        self.state_mode = state_mode
        self.on_transfer = on_transfer  # (name, t0, future): the executor's timeline
        self.flight: dict[tuple, tuple] = {}  # (what, block, mb) -> (future, what it moves)

    @classmethod
    def of_executor(cls, ex, p, tier: Tier | None) -> Offloader:
        """The runner of executor `ex` for the offload pass `p`, over the rank's `tier`
        (`open_tier`, which `runtime.rank.build_rank` calls when `offload.*` asks)."""
        if tier is None:
            raise ValueError(f"rank {ex.rank}: the plan offloads to the memory tier but the rank "
                             "has no tier (offload.* is off)")
        return cls(tier, ex.state, ex.compute, ex.ledger, ex.ctx.xp, ex._comm_event, p.state)

    def handlers(self) -> dict:
        return {Offload: self._offload, WaitOffload: self._wait_offload, Fetch: self._fetch,
                WaitFetch: self._wait_fetch}

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps in the tier."""
        return self.store.ledger.in_use("tier.state")

    def prepare_activations(self, nbytes: int) -> None:
        """The activations' file, made (or grown) to hold `nbytes` (a step's peak in the tier,
        with room for the extents' page alignment)."""
        if nbytes > 0:
            self.store.prepare("act", nbytes + (1 << 20))

    def _submit(self, a, pairs, before=None, after=None):
        t0 = time.perf_counter()
        fut = self.store.copy(pairs, before, after)
        if self.on_transfer is not None:
            self.on_transfer(a.name(), t0, fut)
        return fut

    def _take(self, a):
        fut, held = self.flight.pop((a.what, a.block, a.mb))
        fut.result()  # a TierError (one line) when the storage failed
        return held

    # -- activations ------------------------------------------------------------------------

    def _offload(self, a) -> None:
        if a.what != "act":
            return self._offload_state(a)
        cache = self.compute.caches[(a.mb, a.block)]
        slots = _slots(cache)
        arrays = [_get(c, k) for c, k in slots]
        sizes = [int(x.nbytes) for x in arrays]
        region = self.store.region("act", (a.block, a.mb), sum(sizes))
        offs = np.cumsum([0] + sizes)
        parked = [Parked(tuple(x.shape), np.dtype(x.dtype), int(o)) for x, o in zip(arrays, offs)]

        def download():  # in the tier's thread: the device's bytes, then the extent's
            return [(region[o:o + n], _bytes(to_host(x))) for x, o, n in zip(arrays, offs, sizes)]

        fut = self._submit(a, (), before=download)
        self.flight[("act", a.block, a.mb)] = (fut, (cache, slots, arrays, parked))

    def _wait_offload(self, a) -> None:
        if a.what != "act":
            return self._wait_offload_state(a)
        cache, slots, arrays, parked = self._take(a)
        self.ledger.free(*arrays)  # out of the DDR: wherever they were accounted
        for (c, k), p in zip(slots, parked):
            _put(c, k, p)

    def _fetch(self, a) -> None:
        if a.what != "act":
            return self._fetch_state(a)
        cache = self.compute.caches[(a.mb, a.block)]
        slots = _slots_parked(cache)
        tag = f"activations.mb{a.mb}.{a.block}"
        outs = [self.ledger.alloc(tag, p.shape, p.dtype, self.xp, zero=False)
                for p in (_get(c, k) for c, k in slots)]
        region = self.store.view((a.block, a.mb))
        extents = [(region[p.offset:p.offset + int(o.nbytes)]) for p, o in
                   zip((_get(c, k) for c, k in slots), outs)]
        if self.host:
            pairs = [(_bytes(o), e) for o, e in zip(outs, extents)]
            fut = self._submit(a, pairs)
        else:  # a device: read into host copies, then upload them
            hosts = [np.empty(o.shape, o.dtype) for o in outs]
            pairs = [(_bytes(h), e) for h, e in zip(hosts, extents)]

            def upload():
                for o, h in zip(outs, hosts):
                    o[...] = to_device(self.xp, h)

            fut = self._submit(a, pairs, after=upload)
        self.flight[("act", a.block, a.mb)] = (fut, (cache, slots, outs))

    def _wait_fetch(self, a) -> None:
        if a.what != "act":
            return self._wait_fetch_state(a)
        cache, slots, outs = self._take(a)
        for (c, k), o in zip(slots, outs):
            _put(c, k, o)
        self.store.free((a.block, a.mb))

    # -- optimizer state --------------------------------------------------------------------

    def _kinds(self, a):
        return ("master",) if a.what == "master" else STATE_KINDS[self.state_mode]

    def _fetch_state(self, a) -> None:
        outs = {}
        for k in self._kinds(a):
            src = self.state.flat(k, a.block)  # the state file's segment (host memory)
            outs[k] = self.ledger.alloc(BUFFER_TAGS[k], src.shape, np.float32, self.xp,
                                        zero=False)
        if self.host:
            fut = self._submit(a, [(_bytes(out), _bytes(self.state.flat(k, a.block)))
                                   for k, out in outs.items()])
        else:
            def upload():
                for k, out in outs.items():
                    out[...] = to_device(self.xp, self.state.flat(k, a.block))

            fut = self._submit(a, (), after=upload)
        self.flight[(a.what, a.block, a.mb)] = (fut, outs)

    def _wait_fetch_state(self, a) -> None:
        for k, out in self._take(a).items():
            self.state.place(k, a.block, out)

    def _offload_state(self, a) -> None:
        kinds = self._kinds(a)
        outs = {k: self.state.unplace(k, a.block) for k in kinds}
        if a.what == "master":  # read-only: nothing to write back
            self.ledger.free(*outs.values())
            return
        dsts = {k: _bytes(self.state.flat(k, a.block)) for k in kinds}

        def download():
            return [(dsts[k], _bytes(to_host(out))) for k, out in outs.items()]

        fut = self._submit(a, (), before=download)
        self.flight[(a.what, a.block, a.mb)] = (fut, outs)

    def _wait_offload_state(self, a) -> None:
        self.ledger.free(*self._take(a).values())

    def close(self) -> None:
        """Wait for what is in flight (errors are the caller's), then end the store."""
        for fut, _ in list(self.flight.values()):
            with contextlib.suppress(Exception):  # closing: the error was or will be reported
                fut.result()
        self.flight.clear()
        self.store.close()


def _slots_parked(cache: BlockCache):
    """The (container, key) of every parked array of a cache, in the order they were parked."""
    out = []
    if isinstance(cache.x, Parked):
        out.append((cache, "x"))
    for part in cache.parts or ():
        out += [(part, k) for k, v in part.items() if isinstance(v, Parked)]
    out += [(cache.extra, k) for k, v in cache.extra.items() if isinstance(v, Parked)]
    return out


__all__ = ["Offloader", "Parked", "STATE_KINDS", "Tier", "open_tier"]
