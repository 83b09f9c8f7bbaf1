"""The platform shim: profiles, the DDR ledger, the link throttle, compute pacing."""

from .ledger import DDRCapExceeded, Ledger
from .link import Link
from .pacing import Pacer
from .platform import Profile, ProfileError, load_profile, resolve_platform

__all__ = ["DDRCapExceeded", "Ledger", "Link", "Pacer", "Profile", "ProfileError", "load_profile",
           "resolve_platform"]
