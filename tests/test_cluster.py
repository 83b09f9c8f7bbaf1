"""Two emulated nodes on this host (scripts/cluster.sh): a real multi-node run.

Each node is a network namespace with its own hostname, linked through a bridge and shaped to
1 Gbit/s; Open MPI starts a daemon per node, ranks on different nodes talk TCP, ranks on one node
shared memory. Checked: pp 2 x dp 2 on 2 nodes x 2 ranks is bitwise the run on one host, for
each placement; killing every process of one node ends the job within 60 s, non-zero, naming
the lost ranks. Needs root and network namespaces: run with `--cluster` (scripts/test.sh does);
when the machine does not allow it, the tests fail under CI (`CI=true`) and are skipped with the
reason elsewhere. The
cluster has a name of its own and is taken down whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests._prereq import missing

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster.sh"
MPIRUN = Path(sys.executable).parent / "mpirun"
STEPS = 3
TRAIN = [sys.executable, "-m", "ratrain.train", "--config", str(ROOT / "jobs" / "tiny.yaml"),
         "--set", "parallel.pp=2", "--set", "parallel.dp=2", "--set", "data.eval_interval=0",
         "--set", "model.layers=4", "--set", "model.seq_len=64", "--set", "run.log_interval=100",
         "--set", "run.threads=1"]

pytestmark = pytest.mark.cluster


def why_not() -> str | None:
    """Why emulated nodes cannot run here, or None."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces, veth, tc)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"emulated nodes need '{tool}'"
    if not MPIRUN.exists():
        return f"no mpirun beside {sys.executable}"
    probe = f"ratrain-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "network namespaces are not available here (ip netns add failed)"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        return "UTS namespaces are not available here (unshare --uts failed)"
    return None


_STATE = []  # a private state directory (mkdtemp: root's, mode 0700), made once per session


def _env():
    if not _STATE:
        _STATE.append(os.environ.get("RATRAIN_CLUSTER_STATE") or tempfile.mkdtemp(prefix="ratrain-cluster-"))
    env = dict(os.environ, MPIRUN=str(MPIRUN), PYTHONPATH=str(ROOT), RATRAIN_CLUSTER_STATE=_STATE[0])
    env.pop("OMPI_COMM_WORLD_SIZE", None)
    return env


@pytest.fixture(scope="module")
def cluster():
    reason = why_not()
    if reason:
        missing(reason)  # a failure under CI
    name = f"t{os.getpid() % 10**7}"
    up = subprocess.run([str(CLUSTER), "up", "--nodes", "2", "--slots", "2", "--rate", "1gbit",
                         "--name", name], capture_output=True, text=True, env=_env())
    try:
        assert up.returncode == 0, up.stderr
        yield name
    finally:
        subprocess.run([str(CLUSTER), "down", "--name", name], capture_output=True, env=_env())
        if "RATRAIN_CLUSTER_STATE" not in os.environ:
            shutil.rmtree(_STATE[0], ignore_errors=True)


def _losses(run_dir: Path) -> list:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (run_dir / "metrics.jsonl")
                                                      .read_text().splitlines())]


def _run(cmd, timeout=300):
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


@pytest.mark.parametrize("placement", ["pp", "dp"])
def test_two_nodes_bitwise_the_run_on_one_host(cluster, placement, tmp_path):
    sets = ["--set", f"parallel.placement={placement}", "--set", f"run.steps={STEPS}"]
    two = tmp_path / "two"
    out = _run([str(CLUSTER), "run", "--name", cluster, "--", "-n", "4", *TRAIN, *sets,
                "--set", f"run.dir={two}"])
    assert "2 nodes x 2 ranks" in out.stdout  # the banner: the launcher saw two nodes
    one = tmp_path / "one"
    _run([str(MPIRUN), "-n", "4", "--oversubscribe", *TRAIN, *sets, "--set", f"run.dir={one}"])
    assert len(_losses(two)) == STEPS
    assert _losses(two) == _losses(one)


def test_losing_a_node_ends_the_job_naming_its_ranks(cluster, tmp_path):
    run = subprocess.Popen([str(CLUSTER), "run", "--name", cluster, "--", "-n", "4", *TRAIN,
                            "--set", "run.steps=100000", "--set", f"run.dir={tmp_path}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                           cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):  # training has started
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.2)
        subprocess.run([str(CLUSTER), "kill", "2", "--name", cluster], check=True,
                       capture_output=True, env=_env())
        out, err = run.communicate(timeout=60)  # the bound: a job that hangs fails here
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0, (out[-2000:], err[-3000:])
    assert f"the job lost node {cluster}-n2: MPI rank(s) 2,3" in err, err[-3000:]
