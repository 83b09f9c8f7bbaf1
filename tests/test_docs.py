"""The docs hold together and read easily.

- No sentence of README.md or of any page under docs/ (history and the generated CONFIG.md
  included) runs over 60 words. Table cells and list items count as paragraphs of their own.
- A reference to a section of a page (`docs/X.md, "Heading"`, or `README.md, "Heading"`) names a
  heading that page has, wherever the reference is written.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_WORDS = 60

# A sentence ends at . ! ? or : (a bold run may close after it) before a capital, a bold run, a
# parenthesis or a link; or at . ! ? before a lowercase name or a number ("fp16 adds ...", "0.85
# of sgemm ..."), unless an abbreviation ends there.
_BEFORE_CAPITAL = re.compile(r"([.!?:]\**)\s+(?=[A-Z*(\[])")
_BEFORE_LOWER = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bal)([.!?]\**)\s+(?=[a-z0-9])")


def sentences(text: str) -> list[str]:
    """The prose of a Markdown text cut into sentences. Code blocks and headings are left out;
    each table cell and each list item is a paragraph of its own; inline code is one word."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        bare = line.strip()
        if bare.startswith("#"):
            continue
        if bare.startswith("|"):
            if not re.fullmatch(r"\|[-|: ]+\|", bare):  # a table's rule has no words
                for cell in re.split(r"(?<!\\)\|", bare.strip("|")):
                    lines += ["", cell, ""]
            continue
        if re.match(r"([-*+]|\d+\.)\s", bare):  # a list item, nested or not: its marker
            lines.append("")  # is no word
            line = re.sub(r"^\s*([-*+]|\d+\.)\s+", "", line)
        lines.append(line)
    out = []
    for para in "\n".join(lines).split("\n\n"):
        para = re.sub(r"`[^`]*`", "CODE", " ".join(para.split()))  # a name with dots ends none
        para = _BEFORE_LOWER.sub(r"\1\n", _BEFORE_CAPITAL.sub(r"\1\n", para))
        out += [s for s in para.split("\n") if s.strip()]
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_sentence_over_sixty_words(doc):
    long = [s for s in sentences(doc.read_text()) if len(s.split()) > MAX_WORDS]
    assert not long, long


def test_the_checker_splits_sentences():
    text = ("# A heading. Left out\nOne two. Three `a.b` four! Five\n\n| x. Y | a \\| b |\n"
            "|---|---|\n- six\n  - seven eight\n\n**Bold.** Then fp16 adds, e.g. this. 0.85 "
            "of it\n\n```\nin. Code\n```")
    assert [len(s.split()) for s in sentences(text)] == [2, 3, 1, 1, 1, 3, 1, 2, 1, 5, 3]
    assert not any(len(s.split()) > MAX_WORDS for s in sentences("word " * 59 + "word."))
    assert any(len(s.split()) > MAX_WORDS for s in sentences("| " + "word " * 61 + "|"))


# a page, an optional comma, colon or parenthesis, then the heading in double quotes
REF = re.compile(r"\b((?:docs/[\w/.-]+|README)(?:\.md)?)[,:]?\s+\(?\"([^\"]+)\"")
WHERE = ["README.md", "docs", "ratrain", "benchmarks", "jobs", "scripts", "slurm", "tests"]


def headings(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [h.strip() for h in re.findall(r"^#+ (.*)$", text, flags=re.M)]


def files():
    for top in WHERE:
        path = ROOT / top
        yield from [path] if path.is_file() else (
            p for p in sorted(path.rglob("*")) if p.suffix in (".md", ".py", ".sh", ".yaml",
                                                               ".sbatch") and p.is_file())


def broken(text: str) -> list[str]:
    """The section references of `text` whose page lacks the heading (or is missing)."""
    out = []
    for page, name in REF.findall(" ".join(text.split())):
        path = ROOT / (page if page.endswith(".md") else page + ".md")
        if not path.is_file() or not any(h.startswith(name) for h in headings(path)):
            out.append(f'{page}, "{name}"')
    return out


def test_every_section_reference_names_a_heading():
    bad = {str(p.relative_to(ROOT)): b for p in files()
           if p != Path(__file__) and (b := broken(p.read_text()))}  # this file plants some
    assert not bad, bad


def test_the_reference_check_fails_on_a_missing_heading():
    assert broken('see docs/BENCHMARKS.md, "Current figures" and README.md ("Switches")') == []
    assert broken('docs/BENCHMARKS.md, "No such part"; docs/NOPE.md, "X"') == [
        'docs/BENCHMARKS.md, "No such part"', 'docs/NOPE.md, "X"']
