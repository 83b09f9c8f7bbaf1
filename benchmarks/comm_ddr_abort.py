"""DDR cap: seconds from the failing allocation on rank 1 to the exit of every rank.

    python benchmarks/comm_ddr_abort.py [--ranks 4]

Launches `mpirun -n RANKS` on the script of tests/test_comm_abort.py (rank 1 goes over a 6 MiB
cap while the other ranks wait in an all-reduce through the engine) and prints JSON.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_comm_abort import launch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import tempfile

    times = []
    for _ in range(a.reps):
        with tempfile.TemporaryDirectory() as d:
            proc, t_end = launch(Path(d), cap_mib=6, ranks=a.ranks)
            t_fail = float(next(x.split()[1] for x in proc.stdout.splitlines() if x.startswith("FAIL_AT")))
            ok = proc.returncode != 0 and "DONE" not in proc.stdout and "DDR cap exceeded" in proc.stderr
            times.append((t_end - t_fail, ok))
    print(json.dumps({"ranks": a.ranks, "stop_s": [round(t, 3) for t, _ in times],
                      "max_stop_s": max(t for t, _ in times), "all_ok": all(ok for _, ok in times)}))


if __name__ == "__main__":
    main()
