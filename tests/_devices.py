"""The array modules the device tests run over: numpy, the stand-in (`ratrain.device.standin`:
numpy with cupy's refusals, always), and cupy when this machine has a GPU that works (the GPU
check, scripts/gpu-check.sh, runs these tests there). CI has no GPU: there the stand-in runs
every device path and a missing host/device transfer fails as it would on a GPU."""

import numpy as np

from ratrain.device import DeviceError, open_device, to_host
from ratrain.device.standin import standin


def _gpu():
    try:
        return open_device("gpu")
    except DeviceError:
        return None


GPU = _gpu()
DEVICES = ["standin"] + (["gpu"] if GPU is not None else [])  # the non-host devices here
MODULES = {"cpu": np, "standin": standin, **({"gpu": GPU.xp} if GPU is not None else {})}


def host(a):
    """A host array of a host or device array (numpy passes through)."""
    return to_host(a)
