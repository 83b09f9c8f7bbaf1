"""How a run ends: the exit codes of `python -m ratrain.train`, written once (README.md, "When things
go wrong"; `runctl` documents each). Imports nothing, so that the entry point's first
instruction (`early`) can use them before anything heavy is loaded."""

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_SILENT = 0, 1, 2, 3
EXIT_DIVERGED, EXIT_CHECKPOINT, EXIT_STOPPED, EXIT_INTERRUPTED = 4, 5, 75, 76

__all__ = ["EXIT_CHECKPOINT", "EXIT_DIVERGED", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK",
           "EXIT_SILENT", "EXIT_STOPPED", "EXIT_USAGE"]
