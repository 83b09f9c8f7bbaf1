"""scripts/cluster.sh runs, as root, the agent script it writes into its state directory: a
directory that someone else could have made first (a predictable name in the world-writable
temp folder) is refused, with the reason, before anything is written there."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parents[1] / "scripts" / "cluster.sh"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cluster.sh needs root")


def _status(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLUSTER), "status", "--name", "tstate"], capture_output=True,
                          text=True, env=dict(os.environ, RATRAIN_CLUSTER_STATE=str(state)))


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o1777])
def test_a_state_directory_others_can_enter_or_write_is_refused(tmp_path, mode):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(mode)
    r = _status(state)
    assert r.returncode == 2
    assert f"state directory '{state}' is owned by root with mode {mode & 0o7777:o}" in r.stderr
    assert "RATRAIN_CLUSTER_STATE" in r.stderr and list(state.iterdir()) == []


def test_a_state_directory_of_another_user_or_a_link_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    r = _status(state)
    assert r.returncode == 2 and "not by root with mode 0700" in r.stderr, r.stderr
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    r = _status(link)
    assert r.returncode == 2 and "is a symbolic link" in r.stderr, r.stderr


def test_a_missing_state_directory_is_made_private(tmp_path):
    state = tmp_path / "state"
    r = _status(state)
    assert "state directory" not in r.stderr, r.stderr
    assert (state.stat().st_uid, state.stat().st_mode & 0o7777) == (0, 0o700)
