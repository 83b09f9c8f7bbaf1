"""Checkpoints under faults: a full disk (refused up front, or failing mid-write) never damages
the previous checkpoint and says so in its first words; symbolic links are never followed;
manifest entries are plain shard names; resume auto with nothing usable is an error."""

from __future__ import annotations

import errno
import json
import os

import pytest

from ratrain import checkpoint as ck
from ratrain.checkpoint import space
from ratrain.checkpoint.show import show
from ratrain.config import CheckpointConfig
from tests.test_checkpoint import make_cfg, stage_tensors


def _save(root, step, cfg, **kw):
    return ck.save_checkpoint(root, step, cfg, stage_tensors(cfg, 0, step), {"s": step}, **kw)


def test_save_refused_up_front_when_even_pruning_leaves_no_room(tmp_path, monkeypatch):
    cfg = make_cfg(keep=3)
    root = str(tmp_path)
    first = _save(root, 1, cfg)
    size = space.checkpoint_bytes(first)
    monkeypatch.setattr(space, "free_bytes", lambda path: size // 2)
    with pytest.raises(ck.CheckpointSpaceError) as e:
        _save(root, 2, cfg)
    assert str(e.value).startswith("no space left on device for the checkpoint of step 2 in ")
    assert "nothing was written" in str(e.value) and "last committed checkpoint is intact" in str(e.value)
    assert [s for s, _ in ck.list_checkpoints(root)] == [1]  # the failed save left nothing
    assert ck.verify_checkpoint(first) == []


def test_pruning_ahead_when_keep_would_not_fit(tmp_path, monkeypatch):
    cfg = make_cfg(keep=3)
    root = str(tmp_path)
    for step in (1, 2, 3):
        _save(root, step, cfg)
    size = space.checkpoint_bytes(os.path.join(root, "ckpt-000003"))
    # the disk holds 3.5 checkpoints; its free space follows what is on it
    monkeypatch.setattr(space, "free_bytes", lambda path: int((3.5 - len(
        [p for _, p in ck.list_checkpoints(root) if ck.is_committed(p)])) * size))
    logs = []
    _save(root, 4, cfg, log=logs.append)
    assert any("pruning" in m and "ckpt-000001" in m and "N + 1" in m for m in logs), logs
    assert [s for s, _ in ck.list_checkpoints(root)] == [2, 3, 4]


def test_a_write_that_hits_a_full_disk_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    from ratrain.checkpoint import shard

    cfg = make_cfg()
    root = str(tmp_path)
    first = _save(root, 1, cfg)

    def full(fd, data, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard.os, "pwrite", full)
    with pytest.raises(ck.CheckpointSpaceError) as e:
        _save(root, 2, cfg)
    assert str(e.value).startswith("no space left on device for the checkpoint of step 2")
    assert "\n" not in str(e.value)
    assert [s for s, _ in ck.list_checkpoints(root)] == [1]
    assert ck.verify_checkpoint(first) == []


def test_space_errors_are_recognised():
    assert space.is_space_error(OSError(errno.ENOSPC, "x"))
    assert space.is_space_error(OSError(errno.EDQUOT, "x"))
    wrapped = RuntimeError("Disable slist on flush dest failure failed (..., errno = 28, error "
                           "message = 'No space left on device')")
    assert space.is_space_error(wrapped)
    assert not space.is_space_error(OSError(errno.EACCES, "Permission denied"))


def test_room_problem_at_start_up(tmp_path, monkeypatch):
    cfg = make_cfg()
    monkeypatch.setattr(space, "free_bytes", lambda path: 10)
    msg = space.room_problem(str(tmp_path / "ck"), cfg)
    assert msg.startswith("no space left on device for a checkpoint in ")
    monkeypatch.setattr(space, "free_bytes", lambda path: 2**40)
    assert space.room_problem(str(tmp_path / "ck"), cfg) is None


def test_symlinked_checkpoint_dirs_are_refused_and_never_pruned_through(tmp_path):
    cfg = make_cfg(keep=1)
    elsewhere = tmp_path / "elsewhere"
    other = _save(str(elsewhere), 5, cfg)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(other, root / "ckpt-000001")
    assert ck.list_checkpoints(str(root)) == []
    assert [s for s, _ in ck.linked_checkpoints(str(root))] == [1]
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_resume(CheckpointConfig(dir=str(root)), "x", cfg.model)
    assert "a symbolic link" in str(e.value) and "checkpoint.resume=never" in str(e.value)
    _save(str(root), 2, cfg)
    _save(str(root), 3, cfg)  # keep=1 prunes step 2, never the link
    assert os.path.islink(root / "ckpt-000001")
    assert ck.verify_checkpoint(other) == []  # its manifest is still there


def test_manifest_entries_must_be_shard_names_inside_the_checkpoint(tmp_path, capsys):
    cfg = make_cfg()
    path = _save(str(tmp_path), 1, cfg)
    man = os.path.join(path, "manifest.json")
    data = json.loads(open(man).read())
    data["files"][0]["file"] = "../../../../etc/hostname"
    with open(man, "w") as f:
        json.dump(data, f)
    problems = ck.verify_checkpoint(path)
    assert problems and "not a shard name inside the checkpoint" in problems[0]
    assert show(path, verify=True) == 1
    assert "refused" in capsys.readouterr().out


def test_a_shard_that_is_a_link_is_refused(tmp_path):
    cfg = make_cfg()
    path = _save(str(tmp_path), 1, cfg)
    shard_path = os.path.join(path, "shard-s000.h5")
    os.rename(shard_path, tmp_path / "moved.h5")
    os.symlink(tmp_path / "moved.h5", shard_path)
    assert "a symbolic link" in ck.verify_checkpoint(path)[0]


def test_show_on_a_regular_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert show(str(f)) == 1
    out = capsys.readouterr().out
    assert out.startswith("error: ") and "a file, not a checkpoint directory" in out
    assert out.count("\n") == 1


def test_resume_auto_with_checkpoints_none_usable_is_an_error(tmp_path):
    cfg = make_cfg(keep=5)
    root = str(tmp_path)
    for step in (1, 2):
        _save(root, step, cfg)
        os.truncate(os.path.join(root, f"ckpt-00000{step}", "shard-s000.h5"), 100)
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_resume(CheckpointConfig(dir=root), "x", cfg.model)
    msg = str(e.value)
    assert "2 checkpoint(s)" in msg and "none usable" in msg
    assert "ckpt-000001" in msg and "ckpt-000002" in msg and "truncated" in msg
    assert "checkpoint.resume=never" in msg
    assert ck.resolve_resume(CheckpointConfig(dir=root, resume="never"), "x", cfg.model) is None


def test_resume_auto_with_only_interrupted_saves_starts_fresh(tmp_path):
    (tmp_path / "ckpt-000003").mkdir()
    assert ck.resolve_resume(CheckpointConfig(dir=str(tmp_path)), "x", make_cfg().model) is None
