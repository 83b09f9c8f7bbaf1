"""docs/INTERNALS.md reads as a tour: prose in short sentences (none over 60 words), its layer
table complete (the one list of the layers, which tests/test_imports.py reads)."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "INTERNALS.md"


def sentences(text: str) -> list[str]:
    """The prose of a Markdown text (no code blocks, tables or headings) cut into sentences."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith(("|", "#"))]
    prose = "\n".join(lines).replace("\n- ", "\n\n")  # a list item ends what came before
    out = []
    for para in prose.split("\n\n"):
        para = re.sub(r"`[^`]*`", "CODE", " ".join(para.split()))  # a name with dots ends none
        out += [s for s in re.split(r"(?<=[.!?:])\s+(?=[A-Z*(])", para) if s.strip()]
    return out


def test_no_sentence_over_sixty_words():
    long = [s for s in sentences(DOC.read_text()) if len(s.split()) > 60]
    assert not long, long


def test_the_checker_splits_sentences():
    text = "One two. Three `a.b` four! Five\n\n| x. y |\n- six\n- seven eight"
    assert [len(s.split()) for s in sentences(text)] == [2, 3, 1, 1, 2]


def test_the_layer_table_names_every_package():
    from test_imports import LAYERS, ROOT

    packages = {f"ratrain.{p.parent.name}" for p in ROOT.glob("*/__init__.py")}
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))
