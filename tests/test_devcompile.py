"""Every device kernel compiles for a Hopper card (sm_90) at float32, float16 and bfloat16
arguments (and each 16-bit array alone in bfloat16), with numba-cuda's real compiler and no
card (`tests/_devcompile.py`). The simulator runs the kernels' Python and never compiles them;
this is what checks the compiled path,
bfloat16's loads and stores (`devlaunch.ld`, `st`) above all, before a card's session spends
its time on it. It needs NVVM and NVRTC, which setup.cfg's `devcompile` extra pins (CUDA 13.0's,
the device machine's) and scripts/test.sh installs."""

import os
import subprocess
import sys
from pathlib import Path

from tests._prereq import missing, need

ROOT = Path(__file__).resolve().parents[1]


def _libraries() -> None:
    need("numba.cuda", "the device kernels (numba-cuda, the test extra)")
    pathfinder = need("cuda.pathfinder", "numba-cuda's library finder (numba-cuda brings it)")
    for lib in ("nvvm", "nvrtc"):
        try:
            pathfinder.load_nvidia_dynamic_lib(lib)
        except Exception as e:  # noqa: BLE001 - not found, or found and broken
            missing(f"lib{lib} for numba-cuda's compiler ({type(e).__name__}: {e}); "
                    "pip install the devcompile extra (setup.cfg)")


def test_every_kernel_compiles_for_sm90_in_each_dtype():
    _libraries()
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "_devcompile.py")], env=env,
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")]
    assert len(lines) >= 12, out  # every kernel (the script fails on one it does not list)
    assert "ok rmsnorm_fwd: 7 signatures" in lines, out
