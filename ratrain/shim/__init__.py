"""The platform shim: what one rank's compute cluster has, and making this host behave like it.

Owns: platform profiles with a source for every value (`platform`, `profiles/*.yaml`); the DDR
ledger that accounts and caps every buffer of a rank (`ledger`); the link model and throttle in
two levels, a node's shared interface and each rank's link inside its node (`link`); compute
and memory pacing (`pacing`); the host allocator settings that keep freed memory in the
process, as DDR does (`allocator`); the memory tier below the DDR, its figures, accounting and
throttle (`tier`) and a rank's memory-mapped files in it with their transfer thread
(`tierstore`).

May import: nothing of ratrain but `ratrain.config` (only duck-typed: a `platform` section is
read by attribute) and `ratrain.fileio` (the tier's files); yaml and numpy. It knows nothing of
models, schedules or MPI.
"""

from .ledger import DDRCapExceeded, Ledger
from .link import Levels, Link, Slots
from .pacing import Pacer
from .platform import Profile, ProfileError, load_profile, resolve_platform

__all__ = ["DDRCapExceeded", "Ledger", "Levels", "Link", "Pacer", "Profile", "ProfileError",
           "Slots", "load_profile", "resolve_platform"]
