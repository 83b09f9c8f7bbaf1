"""docs/CONFIG.md covers every config key and is what the generator writes from the code."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from ratrain import configdoc
from ratrain.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_config_md_is_current():
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    assert text == configdoc.generate(), (
        "docs/CONFIG.md is stale: regenerate it with python -m ratrain.configdoc > docs/CONFIG.md")
    assert configdoc.main(["--check", str(ROOT / "docs" / "CONFIG.md")]) == 0


def test_every_key_has_a_row_with_a_meaning():
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    keys = configdoc.all_keys()
    assert len(keys) > 50 and "run.threads" in keys and "data.tokenizer" in keys
    for key in keys:
        rows = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 1, key
        meaning = rows[0].rsplit("|", 2)[-2].strip()
        assert len(meaning) > 8, (key, meaning)
    # a key the loader accepts is a key the reference lists, and the other way round
    cfg = load_config(None, [f"{k}={v}" for k, v in (("run.threads", 3), ("precision", "fp16"))])
    assert cfg.run.threads == 3 and cfg.precision == "fp16"


def test_a_key_without_a_meaning_fails_the_generator(tmp_path):
    @dataclass(frozen=True)
    class Section:
        """A section.

        documented: what it means
        """

        documented: int = 1
        forgotten: int = 2

    with pytest.raises(KeyError, match="forgotten"):
        configdoc._rows(Section, "x.")
    assert configdoc.meanings(Section) == {"documented": "what it means"}
    stale = tmp_path / "CONFIG.md"
    stale.write_text("# old\n")
    assert configdoc.main(["--check", str(stale)]) == 1


def test_type_names():
    assert configdoc.type_name(int) == "int"
    assert configdoc.type_name(tuple[float, float]) == "list of 2 float"
    assert configdoc.type_name(tuple[str, ...]) == "list of string"
    assert configdoc.type_name(int | None) == "int or null"
