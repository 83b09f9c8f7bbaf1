"""The docs hold together: a reference to a section of a page (`docs/X.md, "Heading"`, or
`README.md, "Heading"`) names a heading that page has, wherever the reference is written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHERE = ["README.md", "docs", "ratrain", "benchmarks", "jobs", "scripts", "slurm", "tests"]
# a page, an optional comma, colon or parenthesis, then the heading in double quotes
REF = re.compile(r"\b((?:docs/[\w/.-]+|README)(?:\.md)?)[,:]?\s+\(?\"([^\"]+)\"")


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
