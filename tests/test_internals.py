"""docs/INTERNALS.md's layer table is complete: it is the one list of the layers, which
tests/test_imports.py reads. Its prose is held to short sentences with every doc's, in
tests/test_docs.py."""


def test_the_layer_table_names_every_package():
    from test_imports import LAYERS, ROOT

    packages = {f"ratrain.{p.parent.name}" for p in ROOT.glob("*/__init__.py")}
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))
