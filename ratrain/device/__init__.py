"""Where a rank's arrays live: the host (numpy), a GPU (cupy) or the CPU stand-in of a device.

Owns: choosing the array module of `run.device` and, for a GPU, the card (`select`); every
host/device transfer, host sync, pinned staging buffer and copy stream (`arrays`), so no other
module asks which module it was given; the stand-in (`standin`): numpy underneath, refusing
implicit host conversion as cupy does, so the CPU suite catches a missing transfer; a call's
device operations captured as a graph and replayed (`graphs`; the stand-in's, which checks
each replay against its capture, `standin_graphs`).

May import: numpy, ml_dtypes (bfloat16, cupy's too); cupy, lazily, only where `run.device: gpu`
asks for it. Nothing of ratrain:
every layer above moves its arrays through here.
"""

from ratrain.device.arrays import (
    HostStaging,
    host_floats,
    is_host,
    kind_of,
    module_of,
    stacked_rows,
    storage_of,
    synchronize,
    to_device,
    to_host,
)
from ratrain.device.select import DEVICES, Device, DeviceError, local_rank, open_device

__all__ = ["DEVICES", "Device", "DeviceError", "HostStaging", "host_floats", "is_host",
           "kind_of", "local_rank", "module_of", "open_device", "stacked_rows", "storage_of",
           "synchronize", "to_device", "to_host"]
