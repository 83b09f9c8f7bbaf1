"""What `python -m ratrain.checkpoint show PATH [--verify]` prints.

For one checkpoint: its step, who wrote it, the topology and stage split, a model and training
summary from the saved config, the scalar state, every file with its size and hash, and the
checks (sizes only, or SHA-256 too with `--verify`); exit status 0 when usable. For a
checkpoints directory: every `ckpt-NNNNNN` in it, with its size and whether it is committed.
"""

from __future__ import annotations

import json
import os
import sys


from ratrain.checkpoint.replicas import replica_entries
from ratrain.checkpoint.names import CheckpointError, is_committed, list_checkpoints
from ratrain.checkpoint.space import human_bytes
from ratrain.checkpoint.verify import read_manifest, verify_checkpoint
from ratrain.config import config_from_dict


def _show_root(root: str, out) -> int:
    ckpts = list_checkpoints(root)
    if not ckpts:
        print(f"{root}: no checkpoint here (no manifest.json, no ckpt-NNNNNN directories)", file=out)
        return 1
    print(f"checkpoints under {root}:", file=out)
    for step, p in ckpts:
        size = sum(
            os.path.getsize(os.path.join(p, f)) for f in os.listdir(p) if os.path.isfile(os.path.join(p, f))
        )
        status = "committed" if is_committed(p) else "NOT committed (interrupted save; ignored)"
        print(f"  {os.path.basename(p)}  step {step:>8}  {human_bytes(size):>10}  {status}", file=out)
    return 0


def _show_header(path: str, man: dict, out) -> None:
    topo = man["topology"]
    print(f"checkpoint  {path}  (committed)", file=out)
    print(f"step        {man['step']}", file=out)
    print(
        f"written by  ratrain {man.get('ratrain_version')}, format {man.get('format_version')}, "
        f"{man.get('created', '?')}",
        file=out,
    )
    stages = " ".join(f"s{i}:layers[{a},{b})" for i, (a, b) in enumerate(topo.get("stage_layers", [])))
    print(f"topology    pp={topo['pp']} x dp={topo['dp']} ({topo.get('world_size')} ranks); {stages}", file=out)


def _show_config(cfg: dict, out) -> None:
    m = cfg.get("model", {})
    try:
        c = config_from_dict(cfg)
        nparams = c.model.num_params()
        print(
            f"model       {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']} "
            f"(kv {m['kv_heads']}), ffn {m['ffn_hidden']}, vocab {m['vocab_size']}, seq "
            f"{m['seq_len']}: {nparams / 1e6:.2f}M parameters",
            file=out,
        )
        o = c.optim
        print(
            f"training    precision {c.precision}, policy {c.schedule.policy}, lr {o.lr:g} "
            f"({o.lr_schedule}, warmup {o.warmup_steps}), micro_batch {c.parallel.micro_batch} x "
            f"{c.parallel.num_micro_batches} x dp, run.steps {c.run.steps}",
            file=out,
        )
    except Exception as e:  # noqa: BLE001 - show what can be shown
        print(f"config      unreadable: {e}", file=out)


def _show_state(path: str, man: dict, out) -> None:
    import h5py  # only a rank that reads or writes a shard loads HDF5 (~12 MiB)
    first = os.path.join(path, man["files"][0]["file"]) if man["files"] else None
    if not first or not os.path.isfile(first):
        return
    try:
        with h5py.File(first, "r") as f:
            state = json.loads(f.attrs["state"])
        summary = ", ".join(
            f"{k}={v}" for k, v in state.items() if not isinstance(v, (dict, list))
        )
        nested = [k for k, v in state.items() if isinstance(v, (dict, list))]
        print(f"state       {summary or '-'}" + (f"; + {', '.join(nested)}" if nested else ""), file=out)
    except Exception as e:  # noqa: BLE001 - show what can be shown
        print(f"state       unreadable from {first}: {e}", file=out)


def _show_files(path: str, man: dict, problems: list[str], verify: bool, out) -> None:
    print("files" + ("  (the model: the replicas' mean; then each replica's own state)"
                     if replica_entries(man) else ""), file=out)
    total = 0
    entries = man["files"] + replica_entries(man)
    for e in entries:
        total += e["bytes"]
        f = os.path.join(path, e["file"])
        bad = [p for p in problems if p.startswith(f + ":")]
        status = "FAILED" if bad else ("ok" if verify else "size ok")
        print(
            f"  {e['file']:<16} stage {e['stage']:<3} {len(e['params']):>4} params "
            f"{human_bytes(e['bytes']):>10}  sha256 {e['sha256'][:16]}  {status}",
            file=out,
        )
    print(f"total       {human_bytes(total)} in {len(entries)} file(s)", file=out)


def show(path: str, verify: bool = False, out=None) -> int:
    """Print a checkpoint's step, topology, config summary, files and checks; 0 if usable."""
    out = out or sys.stdout
    if not is_committed(path) and list_checkpoints(path):
        return _show_root(path, out)
    try:
        man = read_manifest(path)
    except CheckpointError as e:
        print(f"error: {e}", file=out)
        return 1
    _show_header(path, man, out)
    _show_config(man["config"], out)
    _show_state(path, man, out)
    problems = verify_checkpoint(path, checksums=verify)
    _show_files(path, man, problems, verify, out)
    if problems:
        print("checks      FAILED:", file=out)
        for p in problems:
            print(f"  {p}", file=out)
        return 1
    print(
        "checks      "
        + ("all files present, sizes and SHA-256 verify" if verify else
           "all files present with their sizes; checksums not checked (add --verify)"),
        file=out,
    )
    return 0
