"""`run.device`: the array module of a rank and, on a GPU, its card.

    dev = open_device("gpu", local_rank=2)     # cupy on card 2 % visible, made current
    dev.xp, dev.name, dev.memory_bytes

`cpu` computes with numpy on the host; `gpu` with cupy on card `local_rank % visible` (several
ranks of a node may share one card); `standin` with the CPU stand-in of a device
(`device.standin`: numpy underneath, cupy's refusals), which runs every device code path on a
CPU. A `gpu` that cannot work (cupy missing or broken, no card visible) is a `DeviceError`
naming `run.device` and the fix, raised before any work.
"""

from __future__ import annotations

import os
import platform as _platform
from dataclasses import dataclass

import numpy as np

from ratrain.device.standin import standin

DEVICES = ("cpu", "gpu", "standin")


class DeviceError(ValueError):
    """`run.device` cannot be used on this machine (one line: the value and the fix)."""


@dataclass(frozen=True)
class Device:
    kind: str  # one of DEVICES
    xp: object  # numpy, cupy or the stand-in
    name: str  # the card's name, or the host's CPU model
    index: int | None = None  # the card (gpu)
    memory_bytes: int | None = None  # the card's memory (gpu)
    visible: int = 1  # cards this process sees (gpu)

    def sharing(self, local_ranks: int) -> int:
        """Ranks of a node of `local_ranks` that compute on this card (local rank % visible)."""
        if self.index is None:
            return 1
        return max(1, len(range(self.index, max(local_ranks, 1), self.visible)))

    def describe(self) -> str:
        if self.kind == "gpu":
            gib = (self.memory_bytes or 0) / 2**30
            return f"gpu {self.index} ({self.name}, {gib:.0f} GiB)"
        return f"{self.kind} ({self.name})"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return _platform.processor() or _platform.machine()


def local_rank() -> int:
    """This process's index among its node's ranks, from the launcher's environment (Open MPI,
    Slurm, MPICH / Hydra); 0 when no launcher says (one process)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID",
                "PMI_LOCAL_RANK"):
        v = os.environ.get(var, "")
        if v.isdigit():
            return int(v)
    return 0


def open_device(kind: str, local_rank: int = 0) -> Device:
    """The `Device` of `run.device: kind` for the rank `local_rank` of its node (see the
    module); a GPU is made current for this process."""
    if kind == "cpu":
        return Device("cpu", np, cpu_model())
    if kind == "standin":
        return Device("standin", standin, cpu_model())
    if kind != "gpu":
        raise DeviceError(f"run.device: {kind!r} is not a device; use one of "
                          f"{', '.join(DEVICES)}")
    return _open_gpu(local_rank)


def _open_gpu(local_rank: int) -> Device:  # pragma: no cover - needs cupy and a GPU
    try:
        import cupy  # only `run.device: gpu` needs cupy, an optional extra
    except ImportError as e:
        raise DeviceError(
            f"run.device: gpu needs cupy, which does not import here ({e}); install the "
            "cupy of this machine's CUDA (pip install cupy-cuda12x or cupy-cuda13x, see "
            "README 'GPU ranks'), or set run.device: cpu") from None
    try:
        visible = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, no card
        raise DeviceError(f"run.device: gpu but no GPU is usable here ({e}); run on a GPU "
                          "node or set run.device: cpu") from None
    if visible < 1:
        raise DeviceError("run.device: gpu but no GPU is visible (CUDA_VISIBLE_DEVICES?); "
                          "run on a GPU node or set run.device: cpu")
    index = local_rank % visible
    try:
        cupy.cuda.Device(index).use()
        props = cupy.cuda.runtime.getDeviceProperties(index)
        ok = float(cupy.arange(4, dtype=cupy.float32).sum()) == 6.0
    except Exception as e:
        raise DeviceError(f"run.device: gpu: card {index} does not work with this cupy ({e}); "
                          "install the cupy of this machine's CUDA, or set run.device: cpu"
                          ) from None
    if not ok:
        raise DeviceError(f"run.device: gpu: card {index} computed a wrong sum; check the "
                          "driver and cupy, or set run.device: cpu")
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return Device("gpu", cupy, name, index, int(props["totalGlobalMem"]), visible)
