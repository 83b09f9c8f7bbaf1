"""Communication: topology, point-to-point verbs, ring / tree collectives, the engine thread.

Importing this package does not initialise MPI; the submodules import mpi4py.MPI (which does).
"""
