"""The architecture, checked from the code: imports point down the layers, there is no cycle, a
ratrain import inside a function says in a comment why it is not at the top (a reason in words,
not a `noqa`), and every package's "May import:" line (in its `__init__` docstring) names each
ratrain package or module it really imports.

The layers are read from their one list, the table in docs/INTERNALS.md ("The layers"): a
package may import only packages of a lower layer, and its own modules; the root package
`ratrain` is a layer-0 module like any other, with no exemption. The checker reads every
module's source with `ast` (nothing is imported), so it also runs on planted trees
(`test_checker_catches_...`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ratrain"

def read_layers(doc: Path) -> dict[str, int]:
    """{module: layer} from the layer table of docs/INTERNALS.md: rows `| N | `a` `b` | ... |`."""
    layers = {}
    for n, names in re.findall(r"^\| (\d) \| ((?:`[\w.]+` ?)+)\|", doc.read_text(), re.M):
        for name in re.findall(r"`([\w.]+)`", names):
            layers["ratrain" if name == "ratrain" else f"ratrain.{name}"] = int(n)
    return layers


LAYERS = read_layers(ROOT.parent / "docs" / "INTERNALS.md")


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(root: Path, path: Path):
    """(imported module, line, inside a function?, the comment on that line or the one above,
    "" when none)."""
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    me = _module_name(root, path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    top = root.name
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                names = [f"{mod}.{a.name}" for a in child.names]  # the module, or a name in it
            for n in names:
                if n == top or n.startswith(top + "."):
                    ln = child.lineno
                    said = lines[ln - 1].partition("#")[2]
                    if not said and ln > 1 and lines[ln - 2].strip().startswith("#"):
                        said = lines[ln - 2].strip()[1:]
                    out.append((n, ln, in_function, said))
            visit(child, inner)

    visit(tree, False)
    return me, out


# tool directives, not reasons
_DIRECTIVES = re.compile(r"noqa(:\s*[\w, ]+)?|type:\s*ignore(\[[^]]*\])?|pragma:[^#]*|fmt:\s*\w+")


def is_reason(comment: str) -> bool:
    """Whether a comment says why in words: two or more words once tool directives are gone."""
    return len(re.findall(r"[A-Za-z]{2,}", _DIRECTIVES.sub("", comment))) >= 2


def may_import(init: Path) -> set[str] | None:
    """The ratrain modules a package's "May import:" line names (`ratrain` alone: the root
    module only); None for a command's "every package below"; an empty set when it names none."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    at = doc.find("May import:")
    if at < 0:
        return set()
    line = doc[at:].split("\n\n")[0]
    line = re.split(r"\bNever\b|\b[Nn]othing else\b", line)[0]
    if "every package below" in line:
        return None
    return set(re.findall(r"`(ratrain(?:\.\w+)*)`", line))


def _allowed(target: str, names: set[str], top: str) -> bool:
    return any(target == n or (n != top and target.startswith(n + ".")) for n in names)


def _layer_of(module: str, layers: dict) -> tuple[str, int] | None:
    """The longest key of `layers` that is `module` or a package holding it."""
    best = None
    for key, level in layers.items():
        if (module == key or module.startswith(key + ".")) and (best is None or len(key) > len(best[0])):
            best = (key, level)
    return best


def check(root: Path, layers: dict) -> list[str]:
    """Every violation under `root`: an import upwards or sideways between packages, a module
    no layer names, a cycle, a function-local ratrain import without a reason, an import its
    package's "May import:" line does not name."""
    problems, graph = [], {}
    modules = {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    lines = {f"{root.name}.{i.parent.name}": (i, may_import(i)) for i in root.glob("*/__init__.py")}
    for path in modules.values():
        me, imports = _imports(root, path)
        mine = _layer_of(me, layers)
        if mine is None:
            problems.append(f"{me}: in no layer (add its package to LAYERS)")
            continue
        for target, line, local, said in imports:
            while target not in modules and "." in target:  # `from pkg import name`
                target = target.rsplit(".", 1)[0]
            theirs = _layer_of(target, layers)
            where = f"{path.relative_to(root.parent)}:{line}"
            if theirs is None:
                problems.append(f"{where}: imports {target}, which is in no layer")
                continue
            if theirs[0] != mine[0] and theirs[1] >= mine[1]:
                problems.append(f"{where}: {me} (layer {mine[1]}) imports {target} (layer "
                                f"{theirs[1]}): imports must point down")
            if local and not is_reason(said):
                problems.append(f"{where}: a ratrain import inside a function needs a comment "
                                "saying why in words (keeping MPI or an optional dependency "
                                "unloaded), not a tool directive")
            pkg = mine[0] if mine[0] in lines else None
            if pkg and not (target == pkg or target.startswith(pkg + ".")):
                init, names = lines[pkg]
                if names is not None and not _allowed(target, names, root.name):
                    problems.append(f"{where}: {me} imports {target}, which the \"May import:\" "
                                    f"line of {init.relative_to(root.parent)} does not name")
            if target != me:
                graph.setdefault(me, set()).add(target)
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return problems


def _cycles(graph: dict) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (iterative DFS)."""
    found, state = [], {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph.get(start, ()))))]
        path, on_path = [start], {start}
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                state[node] = 2
            elif nxt in on_path:
                found.append(path[path.index(nxt):] + [nxt])
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
                on_path.add(nxt)
    return found


def test_ratrain_imports_point_down_without_cycles():
    assert check(ROOT, LAYERS) == []


def test_every_package_init_says_what_it_owns_and_may_import():
    for init in sorted(ROOT.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "may import" in doc.lower(), f"{init}: say what the package owns and what it may import"


def _plant(tmp_path, files: dict) -> Path:
    root = tmp_path / "ratrain"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_checker_catches_an_upward_import_and_a_cycle(tmp_path):
    layers = {"ratrain": 0, "ratrain.shim": 2, "ratrain.comm": 3, "ratrain.plan": 5}
    root = _plant(tmp_path, {
        "__init__.py": "",
        "shim/__init__.py": "",
        "shim/link.py": "from ratrain.comm.engine import CommEngine\n",  # upward
        "comm/__init__.py": "",
        "comm/engine.py": "from ratrain.shim import link\nfrom . import wire\n",
        "comm/wire.py": "from .engine import x\n",  # a cycle inside comm
        "plan/__init__.py": "",
        "plan/cost.py": "def f():\n    from ratrain.comm import engine\n",  # no reason given
    })
    problems = check(root, layers)
    assert any("ratrain.shim.link (layer 2) imports ratrain.comm.engine (layer 3)" in p
               for p in problems), problems
    assert any(p.startswith("import cycle:") and "ratrain.comm.wire" in p for p in problems)
    assert any("plan/cost.py:2" in p and "needs a comment" in p for p in problems)
    # the same tree without them is clean
    root2 = _plant(tmp_path / "ok", {
        "__init__.py": "", "shim/__init__.py": "", "shim/link.py": "import os\n",
        "comm/__init__.py": '"""May import: `ratrain.shim`."""\n',
        "comm/engine.py": "from ratrain.shim import link\n",
        "plan/__init__.py": '"""May import: `ratrain.comm`."""\n',
        "plan/cost.py": "def f():\n    from ratrain.comm import engine  # loads MPI\n",
    })
    assert check(root2, layers) == []


def test_checker_catches_a_root_import_a_lying_line_and_a_directive_for_a_reason(tmp_path):
    layers = {"ratrain": 0, "ratrain.config": 1, "ratrain.shim": 2, "ratrain.comm": 3}
    tree = {
        "__init__.py": "class FastPath: ...\n",
        "config/__init__.py": '"""May import: nothing of ratrain."""\n',
        "shim/__init__.py": '"""May import: `ratrain.config`."""\n',
        "shim/link.py": "from ratrain.config import x\n",
        "comm/__init__.py": '"""Owns: messages.\n\nMay import: `ratrain.shim`. Never exec."""\n',
        "comm/engine.py": "from ratrain.shim import link\n",
    }
    assert check(_plant(tmp_path / "ok", tree), layers) == []
    root = _plant(tmp_path / "bad", {
        **tree,
        "comm/board.py": "from ratrain import FastPath\n",  # the root package, not named
        "comm/wire.py": "from ratrain.config import y\n",  # the line lies: config unnamed
        "comm/hier.py": "def f():\n    from ratrain.shim import link  # noqa: PLC0415\n",
        "config/sections.py": "from ratrain.comm import engine\n",  # the root's layer is no pass
    })
    problems = check(root, layers)
    assert any("comm/board.py:1" in p and "imports ratrain, which" in p and "does not name" in p
               for p in problems), problems
    assert any("comm/wire.py:1" in p and "ratrain.config" in p and "does not name" in p
               for p in problems), problems
    assert any("comm/hier.py:2" in p and "not a tool directive" in p for p in problems), problems
    assert any("config/sections.py:1" in p and "must point down" in p for p in problems), problems
    assert len(problems) == 5, problems  # sections.py also breaks config's own line
    # and the root package itself obeys the layers: layer 0 imports nothing above it
    up = _plant(tmp_path / "up", {**tree, "__init__.py": "from ratrain.comm import engine\n"})
    assert any("ratrain (layer 0) imports ratrain.comm.engine (layer 3)" in p
               for p in check(up, layers))


def test_reason_comments_are_words():
    assert is_reason(" loads MPI too") and is_reason(" optional dependency: torch")
    assert not is_reason(" noqa: PLC0415") and not is_reason(" type: ignore[attr-defined]")
    assert not is_reason(" likewise") and not is_reason("")


@pytest.mark.parametrize("module", sorted(p.name for p in ROOT.glob("*.py")))
def test_every_top_level_module_has_a_layer(module):
    assert _layer_of(f"ratrain.{module[:-3]}".replace(".__init__", ""), LAYERS) is not None
