"""The `Runner` protocol and the registry of runners (see `runtime.passes`)."""

from __future__ import annotations

from collections.abc import Callable


class Runner:
    """A pass's runner in the executor. `handlers()`: `{action type: f(action)}` for the pass's
    actions; `close()`: release what it holds (the executor's owner calls it at the end).

    Gradient hooks, each given what the core would use and returning what the step uses:
    `seed_count(n)`: the micro-batches a backward's seed divides the loss scale by (the global
    batch's, `n`); `norm_partials(sq)`: each block's sum of squares for the step's norm (this
    replica's segments of the synchronised gradients, `sq`); `step_norm(facts, vec, scale,
    norms)`: (the norm that clips this replica, the norm reported, finite on every replica?),
    given the core's (the one global norm, twice, and whether it is finite)."""

    def handlers(self) -> dict:
        return {}

    def start(self) -> None:
        """What the runner does once the rank is built, at the same point on every rank (may be
        collective: `runtime.rank.build_rank` calls it after the recovery choice)."""

    def close(self) -> None:
        pass

    def load_state_dict(self, sd: dict) -> None:
        """The executor's resumed state (`Executor.load_state_dict`), for a runner that keeps
        an optimizer step of its own."""

    def settle(self, pending) -> None:
        """Elastic recovery: finish what the runner owes the committed update `pending`
        (the executor's `_Pending`), as `Executor.settle` does for the blocks."""

    def seed_count(self, n: int) -> int:
        return n

    def norm_partials(self, sq: dict) -> dict:
        return sq

    def step_norm(self, facts, vec, scale: float, norms: tuple) -> tuple:
        return norms


_RUNNERS: dict[str, Callable] = {}


def register(name: str, make: Callable) -> None:
    """Make a pass's runner known: `make(executor, pass_, resource) -> Runner` (`resource`: what
    `build_rank` opened for the pass, or None)."""
    if not name or not callable(make):
        raise ValueError(f"a runner needs a pass's name and a callable (got {name!r}, {make!r})")
    _RUNNERS[name] = make


def unregister(name: str) -> None:
    """Forget a runner registered from outside (a test's)."""
    _RUNNERS.pop(name, None)


def runners_for(executor, passes, resources=None) -> dict:
    """{pass name: its runner} for `executor`'s plan `passes`; a pass without a runner is an
    error naming it."""
    resources = resources or {}
    out = {}
    for p in passes:
        if p.name not in _RUNNERS:
            raise ValueError(f"the plan's pass {p.name!r} has no runner: register one with "
                             "ratrain.runtime.passes.register")
        out[p.name] = _RUNNERS[p.name](executor, p, resources.get(p.name))
    return out


__all__ = ["Runner", "register", "runners_for", "unregister"]
