"""The `Pass` protocol and the registry of passes (see `lifecycle.passes`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from ratrain.lifecycle.schedule import Action

Lists = tuple[tuple[Action, ...], tuple[Action, ...], tuple[Action, ...]]  # first, carried, flush


class Pass:
    """One pass over the step (see the module). A subclass sets `name` and `actions`, and
    overrides the parts it needs; the defaults change nothing. A pass whose lists differ by
    step has a `period` (steps after which they repeat; `period_of`: 1 without one)."""

    name: ClassVar[str] = ""
    actions: ClassVar[tuple[type[Action], ...]] = ()  # the action types it places
    legend: ClassVar[str] = ""  # the grid's words for its actions (`lifecycle.grid.legend`)

    def check(self, policy, stages, passes) -> None:
        """Raise ValueError, one line naming the keys and the fix, where it cannot run with
        `policy` on `stages` (every stage's `StageInfo`) beside the plan's other `passes`."""

    def rewrite(self, lists: Lists, info, phase: int, policy) -> Lists:
        """Stage `info`'s (first, carried, flush) lists of phase `phase` (0 <= phase < period),
        rewritten; `carried` is `first` itself when the policy carries nothing."""
        return lists

    def validator(self, life):
        """Its part of one stage's lifecycle check (`lifecycle.validate.Extension`, for
        `life`); it must handle the pass's actions. None: the pass places no action."""
        return None

    def memory(self, walk):
        """Its part of the memory model's walk (`lifecycle.memory.Walk`: its `cur`, `bump`,
        `sizes`, `blocks`): an object whose `handlers()` is `{action type: f(block, action)}`
        (`Handlers` wraps a dict). None: the pass places no action."""
        return None

    def simulator(self, flat):
        """Its part of the simulator: an object whose `handlers()` is `{action type:
        f(action)}` for `flat`, one rank's step flattened into timed items (`plan.events`: its
        `add`, `busy`, `cost`, `step`, `shards`). None: the pass places no action."""
        return None

    def describe(self) -> str:
        """What the pass does in this plan, for the banner and the grid."""
        return self.name


class Handlers:
    """A part that is only its handlers (`Pass.memory`, `Pass.simulator`)."""

    def __init__(self, handlers: dict):
        self._handlers = dict(handlers)

    def handlers(self) -> dict:
        return self._handlers


def period_of(p: Pass) -> int:
    """Steps after which `p`'s lists repeat (the plan's period: the least common multiple)."""
    return getattr(p, "period", 1)


_REGISTRY: dict[str, Callable] = {}


def register(name: str, of_config: Callable) -> None:
    """Make a pass known: `of_config(cfg, blocks) -> Pass | None`, the pass a config asks for
    (`blocks`: every stage's block names), or None when it asks for none. A name registered
    again is replaced in its place."""
    if not name or not callable(of_config):
        raise ValueError(f"a pass needs a name and a callable (got {name!r}, {of_config!r})")
    _REGISTRY[name] = of_config


def unregister(name: str) -> None:
    """Forget a pass registered from outside (a test's)."""
    _REGISTRY.pop(name, None)


def registered() -> tuple[str, ...]:
    """The names of the known passes, in their order."""
    return tuple(_REGISTRY)


def passes_of(cfg, blocks) -> tuple[Pass, ...]:
    """The passes `cfg` asks for, in registration order, each checked to bear its name."""
    out = []
    for name, of_config in _REGISTRY.items():
        p = of_config(cfg, blocks)
        if p is not None:
            if p.name != name:
                raise ValueError(f"pass registered as {name!r} made a pass named {p.name!r}")
            out.append(p)
    return tuple(out)


def named(passes, name: str):
    """The pass of `passes` called `name`, or None."""
    return next((p for p in passes if p.name == name), None)


__all__ = ["Handlers", "Lists", "Pass", "named", "passes_of", "period_of", "register", "registered", "unregister"]
