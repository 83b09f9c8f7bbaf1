"""The one write protocol: whole or absent, no symlink followed, umask modes, no leftovers."""

import os
import stat

import pytest

from ratrain.fileio import atomic_path, atomic_write, create_exclusive, temp_name


def _leftovers(d):
    return [n for n in os.listdir(d) if ".tmp." in n]


def test_atomic_write_replaces_whole(tmp_path):
    p = tmp_path / "a.txt"
    atomic_write(p, "one")
    atomic_write(p, b"two")
    assert p.read_text() == "two"
    assert _leftovers(tmp_path) == []


def test_failure_leaves_target_and_no_temp(tmp_path):
    p = tmp_path / "a.txt"
    atomic_write(p, "old")
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")
    assert p.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_mode_follows_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "m", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "m").st_mode) == 0o640


def test_never_writes_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    name = tmp_path / "planted"
    os.symlink(victim, name)
    with pytest.raises(FileExistsError):
        os.close(create_exclusive(name))
    assert victim.read_text() == "keep"


def test_replacing_a_link_target_does_not_touch_what_it_pointed_to(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    p = tmp_path / "metrics.jsonl"
    os.symlink(victim, p)
    atomic_write(p, "new")  # the link itself is replaced, never followed
    assert victim.read_text() == "keep"
    assert not os.path.islink(p) and p.read_text() == "new"


def test_temp_names_are_fresh(tmp_path):
    p = tmp_path / "x"
    assert temp_name(p) != temp_name(p)
    assert os.path.dirname(temp_name(p)) == str(tmp_path)


def test_a_temp_file_swapped_for_a_link_is_refused_and_its_target_untouched(tmp_path, monkeypatch):
    """The writer (h5py, safetensors) reopens the temporary file by name: should it become a
    link, nothing after the check follows it (no chmod, no fsync of what it points to), even
    when the swap lands between a check by name and the use (`islink` made blind here)."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    victim.chmod(0o600)
    monkeypatch.setattr(os.path, "islink", lambda p: False)
    with pytest.raises(OSError), atomic_path(tmp_path / "out") as tmp:
        os.unlink(tmp)
        os.symlink(victim, tmp)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "keep"
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
