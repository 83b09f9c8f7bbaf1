"""Optional TensorBoard logging (`run.tensorboard: true`) through tensorboardX.

The metrics rank writes every step record's numbers as `train/<field>` scalars and every eval
record's as `eval/<field>` to `<run.dir>/tensorboard/` (`tensorboard --logdir runs/`). It needs
the small `tensorboardX` package (`pip install 'ratrain[tensorboard]'`); `check()` says so
before any work when it is missing.
"""

from __future__ import annotations

import os

SUBDIR = "tensorboard"


def check() -> None:
    """Raise ValueError naming the fix unless tensorboardX can be imported."""
    try:
        import tensorboardX  # noqa: F401 - optional dependency: only run.tensorboard needs it
    except ImportError:
        raise ValueError(
            "run.tensorboard=true needs the tensorboardX package: pip install "
            "'ratrain[tensorboard]' (or pip install tensorboardX), or set run.tensorboard=false"
        ) from None


class TensorBoard:
    """Scalars of metrics records to `<run_dir>/tensorboard`."""

    def __init__(self, run_dir: str):
        from tensorboardX import SummaryWriter  # optional dependency (see check())

        self.writer = SummaryWriter(os.path.join(run_dir, SUBDIR))

    def log(self, rec: dict, group: str) -> None:
        """Every numeric field of `rec` but `step` as `<group>/<field>` at `rec["step"]`."""
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(f"{group}/{k}", v, rec["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


__all__ = ["SUBDIR", "TensorBoard", "check"]
