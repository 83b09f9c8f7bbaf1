"""Shared fixtures and the `timing` marker.

`timing`: a wall-clock upper bound (something finishes within N seconds, runs at least X% of a
rate). Such checks fail on a loaded machine without anything being wrong, so the test command
skips them; run them on a quiet host with `pytest --timing`. Lower bounds (never faster than
the link model) cannot flake and stay in the plain tests.

`cluster`: tests that start emulated nodes (network namespaces; tests/test_cluster.py). They
run only with `pytest --cluster` (scripts/test.sh passes it in a step of its own); when the
machine does not allow them (not root, no namespaces) they fail under CI and skip with the
reason elsewhere (tests/_prereq.py).

`mpi_group(n)`: a communicator of `n` ranks of MPI.COMM_WORLD for an MPI test (pytest-mpi's
`@pytest.mark.mpi(min_size=n)`); it is freed after the test whatever happens, the test is skipped
when the world has fewer than `n` ranks, and ranks beyond the last whole group of `n` (they sit
the test out) are reported as skipped, not passed.
"""

import os

import pytest

# CI has no GPU: the device kernels (ratrain.exec.devkernels) run in numba-cuda's simulator, which
# must be on before numba is first imported. A run on a GPU sets NUMBA_ENABLE_CUDASIM=0 itself.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def pytest_addoption(parser):
    parser.addoption("--timing", action="store_true", default=False,
                     help="also run the wall-clock upper-bound checks (a quiet machine)")
    parser.addoption("--cluster", action="store_true", default=False,
                     help="also run the tests on emulated nodes (root, network namespaces)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: starts emulated nodes (needs --cluster)")


def pytest_collection_modifyitems(config, items):
    timing = pytest.mark.skip(reason="wall-clock upper bound: run with --timing on a quiet host")
    cluster = pytest.mark.skip(reason="emulated nodes: run with --cluster (scripts/test.sh does)")
    for item in items:
        if "timing" in item.keywords and not config.getoption("--timing"):
            item.add_marker(timing)
        if "cluster" in item.keywords and not config.getoption("--cluster"):
            item.add_marker(cluster)


@pytest.fixture
def mpi_group():
    from mpi4py import MPI  # only MPI tests ask for this fixture

    made = []

    def group(n: int):
        world = MPI.COMM_WORLD
        if world.Get_size() < n:
            pytest.skip(f"needs {n} ranks (the world has {world.Get_size()})")
        rank = world.Get_rank()
        whole = (world.Get_size() // n) * n
        comm = world.Split(rank // n if rank < whole else MPI.UNDEFINED, rank)  # collective
        if comm == MPI.COMM_NULL:
            pytest.skip(f"rank {rank} sits out: the test runs on groups of {n} ranks")
        made.append(comm)
        return comm

    yield group
    for comm in made:
        comm.Free()
