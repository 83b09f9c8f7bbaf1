"""The run section: where a run writes, how long it goes, when it stops early, and the
choices of how a rank computes; typed, documented and checked as the other sections are
(`sections`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ratrain.config.sections import _choice, _positive
from ratrain.config.typedyaml import ConfigError
from ratrain.device.select import DEVICES


@dataclass(frozen=True)
class RunConfig:
    """The run: where it writes, how long it goes, and when it stops early.

    name: the run's name (under Slurm, the job name); dir defaults to runs/<name>
    dir: run directory (config.yaml, metrics.jsonl, eval.jsonl, status.json, trace.json,
        checkpoints); "" = runs/<name>, or runs/default without a name
    steps: total optimizer steps (a resumed run continues up to this step)
    log_interval: steps between progress lines
    trace: write trace.json (Chrome trace events; Perfetto) at the end; without it a rank keeps
        only the current step's timeline
    trace_bytes: with trace, the most bytes of timeline each rank keeps (26 bytes an event, in
        blocks of 1,024 events, at least one; counted by the DDR ledger as trace.timeline);
        the oldest steps are dropped beyond
    threads: compute threads per rank; 0 = the cores the launcher gives this rank (its CPU
        affinity, shared by the node's ranks that have the same cores)
    device: where each rank computes: cpu (numpy), gpu (cupy on card local_rank % visible
        cards; needs the gpu extra, see README "GPU ranks"), or standin (the CPU stand-in of a
        device: numpy with cupy's refusals, for testing the device paths without a GPU)
    tensorboard: also log scalars to <run.dir>/tensorboard (needs the tensorboard extra:
        tensorboardX)
    time_limit: seconds of wall clock from start-up the run may use; it stops at a step boundary
        early enough to write a checkpoint and exits 75 (run again to continue); 0 = no limit
    stop_signals: signals that ask for a graceful stop (checkpoint at the next step boundary,
        exit 75; a second one exits at once with what is committed); [] = the default actions
    stop_grace: seconds a graceful stop may take before the run exits at once; 0 = no limit
    fused: the compiled CPU kernels (numba, the fast extra: fused RMSNorm, RoPE, SwiGLU, AdamW):
        auto (on when numba imports) | on (refused when numba does not import) | off (numpy
        only); RATRAIN_FUSED overrides it
    devkernels: the fused device kernels (numba-cuda) on a GPU rank: auto (on when numba-cuda
        imports) | on (refused when it does not) | off (cupy only) | sim (on the stand-in, in
        numba-cuda's simulator: tests only) | count (on the stand-in, each kernel computed on
        the host and counted as its launches: benchmarks/launches.py); RATRAIN_DEVKERNELS
        overrides it
    attention: the attention backend, auto (this device's best) or a registered backend's name.
        The built-in ones: tiled-64 (the tiled online softmax at tile 64: the host's auto),
        tiled-1024 (tile 1024: the stand-in's auto, and a GPU's at fp32 or where cudnn cannot
        run, the banner saying why) and cudnn (cuDNN's fused SDPA: a GPU's auto at fp16 and
        bf16; refused elsewhere). cudnn-count is cuDNN's backend on the stand-in at fp16 and
        bf16, its calls counted and computed by the tiled path (benchmarks/launches.py). A program may register its own (docs/INTERNALS.md, "An
        attention backend")
    graphs: auto | on | off: a device's block calls as CUDA graphs, each captured once per
        micro-batch in flight and replayed by one host launch (exec.graphs; eager the
        reference). auto: where every op of a block call captures (the stand-in at fp16 and
        bf16 with cuDNN's attention, no offload.activations; not a card yet); on: refused else
    reference_ops: ops that run their reference (the array module's composition: numpy,
        cupy) whatever run.fused and run.devkernels give the rest: any of rmsnorm, rope, swiglu,
        cross_entropy, adamw, grad_norm, cast; [] = none (A/B trials of one kernel, and a way
        round one that misbehaves)
    blas: the BLAS of a CPU rank's GEMMs: auto | openblas | mkl. openblas is numpy's own, the
        reference. mkl is oneMKL (the mkl extra), whose GEMMs take bf16 operands natively (fp16
        where the CPU has AMX-FP16), with 16-bit activations between them; refused where it
        does not load. auto takes mkl where the CPU has AMX (amx_bf16), else openblas; the
        banner says which ran and why (docs/INTERNALS.md, "How a choice is made")
    head: how the head makes its logits: auto | once | chunks. once: a device at fp16 or bf16
        computes them once, whole and in 16 bits, with their gradient written over them in the
        loss's own kernel; the cache keeps them (2 bytes a token and vocabulary entry, as
        PyTorch's autocast keeps its logits) for the backward's two GEMMs. chunks: in fp32
        chunks of head_chunk_mib, recomputed by the backward (the host's only way). auto: once
        where it can be, else chunks (docs/INTERNALS.md, "Decisions, and why")
    head_chunk_mib: the bound, in MiB, on the fp32 logits the head's loss makes at once in
        chunks (its forward by rows, its backward by vocabulary columns; the ledger counts the
        chunk's workspace); 0 = the device's (cpu 16, a core's cache; gpu and standin 256)
    malloc: the host allocator: tuned (freed memory stays in the process, as a cluster's DDR
        pool; ratrain/shim/allocator.py) | default (glibc's own); RATRAIN_MALLOC overrides it
    """
    name: str = ""  # the run's name (Slurm: the job name); run.dir defaults to runs/<name>
    dir: str = ""  # where the run writes; "" = runs/<run.name>, or runs/default without a name
    steps: int = 10
    log_interval: int = 1
    trace: bool = False
    trace_bytes: int = 64 << 20  # with trace: the timeline a rank keeps at most
    threads: int = 0  # compute threads per rank (micro-batch split); 0 = auto
    device: str = "cpu"  # cpu | gpu | standin
    tensorboard: bool = False
    # seconds of wall clock from start-up the run may use (0 = no limit): it stops at a step
    # boundary early enough to write a checkpoint, then exits 75 (run again to continue)
    time_limit: float = 0.0
    # signals that ask for a graceful stop (checkpoint at the next step boundary, exit 75); a
    # second one exits at once with what is committed; [] = the default actions
    stop_signals: tuple[str, ...] = ("TERM", "USR1")
    stop_grace: float = 300.0  # seconds a graceful stop may take before exiting at once; 0 = no limit
    # YAML reads a bare on / off as a bool: true / false stand for on / off (__post_init__)
    fused: str | bool = "auto"  # auto | on | off (RATRAIN_FUSED)
    devkernels: str | bool = "auto"  # auto | on | off | sim | count (RATRAIN_DEVKERNELS)
    attention: str = "auto"  # auto | a backend's name
    graphs: str | bool = "auto"  # auto | on | off: the blocks' calls as device graphs
    reference_ops: tuple[str, ...] = ()  # ops on their reference whatever fused / devkernels say
    blas: str = "auto"  # auto | openblas | mkl: a CPU rank's GEMMs
    head: str = "auto"  # auto | once | chunks: the head's logits made once (16-bit, whole)
    head_chunk_mib: int = 0  # the head's logits chunk, MiB; 0 = the device's (cpu 16, gpu 256)
    malloc: str = "tuned"  # tuned | default (RATRAIN_MALLOC)

    SIGNALS = ("TERM", "INT", "USR1", "USR2", "HUP", "XCPU")
    HEADS = ("auto", "once", "chunks")

    def __post_init__(self) -> None:
        for key in ("fused", "devkernels", "graphs"):  # YAML's on / off: bools, made words
            if isinstance(getattr(self, key), bool):
                object.__setattr__(self, key, "on" if getattr(self, key) else "off")
        if not self.dir:  # resolved once, so that every reader sees the same path
            object.__setattr__(self, "dir", os.path.join("runs", self.name or "default"))

    def check(self) -> None:
        _positive(self, "run", "steps")
        _positive(self, "run", "log_interval")
        _positive(self, "run", "trace_bytes")
        if self.threads < 0:
            raise ConfigError(f"run.threads={self.threads} must be >= 0 (0 = auto)")
        if self.head_chunk_mib < 0:
            raise ConfigError(f"run.head_chunk_mib={self.head_chunk_mib} must be >= 0 (0 = the "
                              "device's: cpu 16, gpu 256)")
        if self.device not in DEVICES:
            raise ConfigError(f"run.device={self.device!r} is not a device: use one of "
                              f"{', '.join(DEVICES)}")
        if os.sep in self.name or self.name in (".", ".."):
            raise ConfigError(f"run.name={self.name!r} must be a plain name (no {os.sep!r})")
        for key in ("time_limit", "stop_grace"):
            if getattr(self, key) < 0:
                raise ConfigError(f"run.{key}={getattr(self, key)} must be >= 0 (0 = no limit)")
        _choice(self, "run", "fused", ("auto", "on", "off"))
        _choice(self, "run", "devkernels", ("auto", "on", "off", "sim", "count"))
        _choice(self, "run", "graphs", ("auto", "on", "off"))
        _choice(self, "run", "head", self.HEADS)
        _choice(self, "run", "malloc", ("tuned", "default"))
        _choice(self, "run", "blas", ("auto", "openblas", "mkl"))
        if not self.attention:
            raise ConfigError("run.attention is empty: use auto or a backend's name")
        bad = [s for s in self.stop_signals if s.upper().removeprefix("SIG") not in self.SIGNALS]
        if bad:
            raise ConfigError(f"run.stop_signals: {bad[0]!r} is not one of {', '.join(self.SIGNALS)}")


def head_once_refused(device: str, precision: str) -> str:
    """The one line refusing `run.head=once` on `device` at `precision`."""
    return (f"run.head=once computes the head in 16 bits on a device (gpu or standin at fp16 "
            f"or bf16), not {device} at {precision}: set run.head=auto or chunks")


__all__ = ["RunConfig", "head_once_refused"]
