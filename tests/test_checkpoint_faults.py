"""Checkpoints under faults: a full disk (refused up front, or failing mid-write) never damages
the previous checkpoint and says so in its first words; symbolic links are never followed;
manifest entries are plain shard names; resume auto with nothing usable is an error."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from ratrain import checkpoint as ck
from ratrain.checkpoint import space
from ratrain.checkpoint.audit import seal
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
    assert "checksum mismatch" in ck.verify_checkpoint(path)[0]  # the seal sees the edit
    with open(man, "w") as f:  # and a forged seal does not let it through
        json.dump(seal(data), f)
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


# -- the manifest checked like a shard (issue 33) ---------------------------------------------


def _rewrite(path, edit, sealed=True):
    """Edit a checkpoint's manifest (a dict -> None function), re-sealed as only a deliberate
    edit could, or left with its old seal."""
    man = os.path.join(path, "manifest.json")
    data = json.loads(open(man).read())
    edit(data)
    with open(man, "w") as f:
        json.dump(seal(data) if sealed else data, f)


def test_the_manifest_is_sealed_and_its_step_is_the_directorys(tmp_path):
    cfg = make_cfg(keep=3)
    older, path = _save(str(tmp_path), 1, cfg), _save(str(tmp_path), 2, cfg)
    _rewrite(path, lambda m: m.update(step=8), sealed=False)
    (problem,) = ck.verify_checkpoint(path)
    assert "manifest.json: checksum mismatch" in problem and "\n" not in problem
    _rewrite(path, lambda m: m.update(step=8))  # a forged seal: the directory's name disagrees
    assert "its step 8 disagrees with the directory's name ckpt-000002" in ck.verify_checkpoint(path)[0]
    logs = []
    assert ck.resolve_resume(CheckpointConfig(dir=str(tmp_path)), "x", cfg.model,
                             log=logs.append) == older
    assert "skipping" in logs[0] and "resuming from" in logs[1] and len(logs) == 2
    renamed = os.path.join(str(tmp_path), "ckpt-000008")
    os.rename(path, renamed)  # name and manifest agree now; the shard's own record does not
    assert "shard-s000.h5: its step is 2, the manifest says 8" in ck.verify_checkpoint(renamed)[0]
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_resume(CheckpointConfig(resume=renamed), "x", cfg.model)
    assert "\n" not in str(e.value) and "its step is 2" in str(e.value)


def test_an_unsealed_manifest_is_read_only_as_format_1(tmp_path):
    cfg = make_cfg()
    path = _save(str(tmp_path), 3, cfg)
    _rewrite(path, lambda m: m.pop("manifest_sha256"), sealed=False)
    assert "no 'manifest_sha256'" in ck.verify_checkpoint(path)[0]
    _rewrite(path, lambda m: m.update(format_version=1), sealed=False)  # as written before seals
    assert ck.verify_checkpoint(path) == []
    _rewrite(path, lambda m: m.update(step=30), sealed=False)
    assert "disagrees with the directory's name" in ck.verify_checkpoint(path)[0]


def test_fields_of_the_wrong_type_are_verdicts(tmp_path):
    cfg = make_cfg()
    path = _save(str(tmp_path), 1, cfg)
    for edit, needle in [
        (lambda m: m.update(step="1"), "is not a whole number"),
        (lambda m: m["files"][0].update(bytes=-5), "byte count is not a whole number"),
        (lambda m: m["files"][0].update(params=[1]), "parameter list is not"),
        (lambda m: m["files"][0].update(kinds=["master", "w"]), "are not buffers of"),
        (lambda m: m["topology"].update(pp=2), "needs one shard per stage"),
        (lambda m: m["topology"]["ranks"].append({"stage": 0, "replica": 1}), "grid"),
        (lambda m: m["config"]["parallel"].update(pp="x"), "its config does not load"),
        (lambda m: m["config"]["model"].update(layers=6), "disagree with its config's split"),
        (lambda m: m["config"]["model"].update(vocab_size=48), "the model's is (48, 16)"),
    ]:
        saved = open(os.path.join(path, "manifest.json")).read()
        _rewrite(path, edit)
        problems = ck.verify_checkpoint(path)
        assert problems and needle in " ".join(problems), (needle, problems)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            f.write(saved)
    assert ck.verify_checkpoint(path) == []


def test_extra_foreign_and_mixed_shards_are_refused(tmp_path):
    from tests.test_checkpoint import save_layout

    a = save_layout(str(tmp_path / "a"), 2, 2, 1)
    b = save_layout(str(tmp_path / "b"), 2, 2, 1)
    c = save_layout(str(tmp_path / "c"), 3, 2, 1)
    shutil.copy(os.path.join(a, "shard-s001.h5"), os.path.join(a, "shard-s002.h5"))
    assert "shard-s002.h5: a shard the manifest does not list" in ck.verify_checkpoint(a)[0]
    # a shard of another checkpoint, its hash forged into b's manifest: its own step says so
    dst = os.path.join(b, "shard-s001.h5")
    shutil.copy(os.path.join(c, "shard-s001.h5"), dst)
    size, sha = os.path.getsize(dst), ck.sha256_file(dst)
    _rewrite(b, lambda m: m["files"][1].update(bytes=size, sha256=sha))
    problems = ck.verify_checkpoint(b)
    assert any("shard-s001.h5: its step is 3, the manifest says 2" in p for p in problems)
    assert any("2 different training states" in p for p in problems)


def test_resume_needs_every_buffer_and_says_so_in_one_line(tmp_path):
    cfg = make_cfg()
    t = stage_tensors(cfg, 0, 1)
    del t["m"], t["v"]
    path = ck.save_checkpoint(str(tmp_path), 1, cfg, t, {})
    assert ck.verify_checkpoint(path) == []  # masters only: enough for eval and export
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_resume(CheckpointConfig(resume=path), "x", cfg.model)
    assert "holds no 'm' state" in str(e.value) and "\n" not in str(e.value)
    os.unlink(os.path.join(path, "shard-s000.h5"))
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_resume(CheckpointConfig(dir=str(tmp_path)), "x", cfg.model)
    assert "none usable (ckpt-000001: " in str(e.value) and "\n" not in str(e.value)


def test_the_saved_model_is_compared_as_the_config_loads_it(tmp_path):
    """A key absent from the saved config takes its default (found by the fuzzer: a forged
    manifest without model.rope_theta was refused as another model, not read as the same)."""
    cfg = make_cfg()
    path = _save(str(tmp_path), 1, cfg)
    _rewrite(path, lambda m: m["config"]["model"].pop("rope_theta"))
    assert ck.resolve_resume(CheckpointConfig(dir=str(tmp_path)), "x", cfg.model) == path
