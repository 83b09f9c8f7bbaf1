"""Each module about one thing: no file under ratrain/ is over 600 lines. A file that grows past
it is split along a real seam (as `exec.head` left `exec.layers`, and `exec.devlaunch` left
`exec.devkernels`), not trimmed."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ratrain"
MAX_LINES = 600


def long_files(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """{path under root: its lines} of every file over `limit` lines (compiled caches aside;
    links to directories are not followed: ratrain/jobs is the repository's jobs/)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = Path(folder, name)
            if path.suffix == ".pyc" or path.is_symlink():
                continue
            n = path.read_bytes().count(b"\n")
            if n > limit:
                out[str(path.relative_to(root))] = n
    return out


def test_no_file_under_ratrain_is_over_600_lines():
    assert long_files(ROOT) == {}, "split these along a seam"


def test_the_check_finds_a_long_file(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "pkg" / "data.yaml").write_text("a: 1\n" * (MAX_LINES + 5))
    assert long_files(tmp_path) == {"pkg/long.py": MAX_LINES + 1, "pkg/data.yaml": MAX_LINES + 5}
