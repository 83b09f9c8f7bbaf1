"""The checkpoint corruption fuzzer: random damage to a run's committed checkpoints, and the
oracle that judges each restart (tests/test_checkpoint_fuzz.py runs a few seeded cases in CI,
benchmarks/ckpt_fuzz.py thousands).

A case copies a pristine checkpoints directory (two committed checkpoints of a real run),
applies one to three random damages (`DAMAGES`) to the newest, the older or both, and asks
`resume auto` which checkpoint to take (`judge`): it must take the newest checkpoint that is
intact, or refuse in one line when none is, the same on every rank, and never raise anything
but a one-line CheckpointError. A checkpoint counts as damaged when any byte of its directory
differs from the pristine copy. Most damages are raw (as a disk or a careless edit leaves
them) and must be refused; the `forged_*` ones also re-seal the manifest, as only a deliberate
edit could, and test the cross-checks behind the seal: such a checkpoint may be taken only when
everything a load reads from it (step, state, config, every array) is bitwise the pristine
one's.

`restart` then runs the trainer on a damaged run directory and checks the process's side:
exit 0 having resumed at the step the oracle expects, with a final checkpoint bitwise equal to
a clean resume from that checkpoint (`final_state`), or exit 2 with one line on stderr; never a
traceback.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np

from ratrain import checkpoint as ck
from ratrain.checkpoint.audit import seal
from ratrain.config import CheckpointConfig
from ratrain.train.startup import finished_message

PAGE = 4096


# -- damages: each takes (rng, the checkpoint, the other checkpoint), returns what it did -----


def _files(path: str) -> list[str]:
    return sorted(os.listdir(path))


def _shards(path: str) -> list[str]:
    return [f for f in _files(path) if f.startswith("shard-")]


def _target(rng: random.Random, path: str) -> str:
    """A file of the checkpoint: the manifest a third of the time, else a shard."""
    shards = _shards(path)
    if not shards or rng.random() < 1 / 3:
        return os.path.join(path, ck.MANIFEST)
    return os.path.join(path, rng.choice(shards))


def flip_bits(rng, path, other):
    f = _target(rng, path)
    data = bytearray(open(f, "rb").read())
    if not data:
        return f"flip: {os.path.basename(f)} is empty"
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    open(f, "wb").write(data)
    return f"flip bits in {os.path.basename(f)}"


def truncate(rng, path, other):
    f = _target(rng, path)
    size = os.path.getsize(f)
    n = rng.randrange(size) if size else 0
    os.truncate(f, n)
    return f"truncate {os.path.basename(f)} to {n} of {size}"


def zero_page(rng, path, other):
    f = _target(rng, path)
    size = os.path.getsize(f)
    off = rng.randrange(max(1, (size + PAGE - 1) // PAGE)) * PAGE
    with open(f, "r+b") as h:
        h.seek(off)
        h.write(bytes(min(PAGE, max(0, size - off))))
    return f"zero the page at {off} of {os.path.basename(f)}"


def overwrite_1k(rng, path, other):
    f = _target(rng, path)
    size = os.path.getsize(f)
    off = rng.randrange(max(1, size))
    with open(f, "r+b") as h:
        h.seek(off)
        h.write(rng.randbytes(min(1024, max(1, size - off))))
    return f"overwrite 1 KiB at {off} of {os.path.basename(f)}"


def append(rng, path, other):
    f = _target(rng, path)
    with open(f, "ab") as h:
        h.write(rng.randbytes(rng.randint(1, PAGE)))
    return f"append to {os.path.basename(f)}"


def _leaves(obj, at=()):
    """(path, value) of every leaf of a JSON document."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*at, i))
    else:
        yield at, obj


def _containers(obj, at=()):
    """(path, dict) of every object of a JSON document."""
    if isinstance(obj, dict):
        yield at, obj
        for k, v in obj.items():
            yield from _containers(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _containers(v, (*at, i))


def _get(obj, at):
    for k in at:
        obj = obj[k]
    return obj


def _new_number(rng, v):
    if isinstance(v, float):
        return rng.choice([v * 2, -v, v + 1e-7, 0.0, float(rng.randint(0, 10**6))]) or 1.5
    return rng.choice([v + 1, v - 1, v * 10 + 1, 0, 999991, rng.randint(0, 10**6)])


def _edit_manifest(rng, path, other, *, kind: str, forge: bool) -> str:
    f = os.path.join(path, ck.MANIFEST)
    m = json.loads(open(f).read())
    what = kind
    if kind == "number":
        nums = [(a, v) for a, v in _leaves(m) if isinstance(v, (int, float))
                and not isinstance(v, bool)]
        at, v = rng.choice(nums)
        new = _new_number(rng, v)
        if new == v:
            new = v + 1
        _get(m, at[:-1])[at[-1]] = new
        what = f"number {'.'.join(map(str, at))}: {v} -> {new}"
    elif kind == "string":
        strs = [(a, v) for a, v in _leaves(m) if isinstance(v, str)]
        at, v = rng.choice(strs)
        new = (v[:-1] + ("x" if not v.endswith("x") else "y")) if v else "x"
        _get(m, at[:-1])[at[-1]] = new
        what = f"string {'.'.join(map(str, at))}"
    else:  # a key renamed, deleted or added
        at, obj = rng.choice(list(_containers(m)))
        op = rng.choice(["rename", "delete", "add"]) if obj else "add"
        if op == "add":
            obj[f"extra_{rng.randrange(100)}"] = rng.randrange(100)
        else:
            key = rng.choice(list(obj))
            value = obj.pop(key)
            if op == "rename":
                obj[key + "_"] = value
        what = f"key {op} in {'.'.join(map(str, at)) or 'the top level'}"
    if forge:
        m = seal(m)
    open(f, "w").write(json.dumps(m, indent=1))
    return ("forged " if forge else "") + "manifest " + what


def manifest_digit(rng, path, other):
    """One digit of the manifest's text changed, as an editor or a bad sector would."""
    f = os.path.join(path, ck.MANIFEST)
    text = open(f).read()
    digits = [m.start() for m in re.finditer(r"\d", text)]
    i = rng.choice(digits)
    d = str((int(text[i]) + rng.randint(1, 9)) % 10)
    open(f, "w").write(text[:i] + d + text[i + 1:])
    return f"manifest digit at {i} -> {d}"


def missing_shard(rng, path, other):
    shards = _shards(path)
    if not shards:
        return "missing shard: none left"
    f = rng.choice(shards)
    os.unlink(os.path.join(path, f))
    return f"delete {f}"


def extra_shard(rng, path, other):
    shards = _shards(path)
    if not (shards or _shards(other)):
        return "extra shard: none to copy"
    src = os.path.join(path if shards else other, rng.choice(shards or _shards(other)))
    taken = {int(f[7:10]) for f in _shards(path) + _shards(other)}
    name = ck.shard_name(max(taken) + 1 + rng.randrange(3))
    shutil.copyfile(src, os.path.join(path, name))
    return f"an extra {name}"


def other_step_shard(rng, path, other):
    if not _shards(other):
        return "other step's shard: none"
    f = rng.choice(_shards(other))
    shutil.copyfile(os.path.join(other, f), os.path.join(path, f))
    return f"{f} from {os.path.basename(other)}"


def other_step_manifest(rng, path, other):
    shutil.copyfile(os.path.join(other, ck.MANIFEST), os.path.join(path, ck.MANIFEST))
    return f"manifest from {os.path.basename(other)}"


def forged_other_step_shard(rng, path, other):
    """A shard of the other checkpoint, its size and hash written into a re-sealed manifest."""
    if not _shards(other):
        return "forged other step's shard: none"
    f = rng.choice(_shards(other))
    dst = os.path.join(path, f)
    shutil.copyfile(os.path.join(other, f), dst)
    man = os.path.join(path, ck.MANIFEST)
    m = json.loads(open(man).read())
    for e in m["files"]:
        if e["file"] == f:
            e["bytes"], e["sha256"] = os.path.getsize(dst), ck.sha256_file(dst)
    open(man, "w").write(json.dumps(seal(m), indent=1))
    return f"forged: {f} from {os.path.basename(other)} with its hash"


def swap_shards(rng, path, other):
    shards = _shards(path)
    if len(shards) < 2:
        return other_step_shard(rng, path, other)
    a, b = rng.sample(shards, 2)
    pa, pb = os.path.join(path, a), os.path.join(path, b)
    os.rename(pa, pa + ".x")
    os.rename(pb, pa)
    os.rename(pa + ".x", pb)
    return f"swap {a} and {b}"


DAMAGES = {f.__name__: f for f in (
    flip_bits, truncate, zero_page, overwrite_1k, append, manifest_digit, missing_shard,
    extra_shard, other_step_shard, other_step_manifest, forged_other_step_shard, swap_shards)}
for _kind in ("number", "key", "string"):  # edits of the parsed manifest, raw and re-sealed
    DAMAGES[f"manifest_{_kind}"] = functools.partial(_edit_manifest, kind=_kind, forge=False)
    DAMAGES[f"forged_{_kind}"] = functools.partial(_edit_manifest, kind=_kind, forge=True)


# -- the oracle -----------------------------------------------------------------------------


def snapshot(path: str) -> dict[str, bytes]:
    return {f: open(os.path.join(path, f), "rb").read() for f in _files(path)}


def checkpoints(root: str) -> list[str]:
    """The checkpoints under `root`, newest first."""
    return [p for _, p in reversed(ck.list_checkpoints(root))]


@dataclass
class Case:
    seed: int
    damages: list[str] = field(default_factory=list)
    damaged: dict[str, bool] = field(default_factory=dict)  # checkpoint name -> damaged
    forged: dict[str, bool] = field(default_factory=dict)
    expect: str | None = None  # the checkpoint name the oracle requires (None: a refusal)
    took: str | None = None  # what resume auto took (None: refused)
    failure: str = ""  # why the case failed ("": passed)
    outcome: str = ""  # "resume <step>", "refuse"


def damage(rng: random.Random, root: str, pristine: dict[str, dict[str, bytes]], case: Case):
    """Apply 1-3 damages to the newest, the older or both checkpoints under `root`."""
    ckpts = checkpoints(root)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        i = rng.choice([0, 0, 1]) if len(ckpts) > 1 else 0
        name = rng.choice(list(DAMAGES))
        path, other = ckpts[i], ckpts[1 - i] if len(ckpts) > 1 else ckpts[0]
        try:
            what = DAMAGES[name](rng, path, other)
            if name.startswith("forged"):
                case.forged[os.path.basename(path)] = True
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            what = flip_bits(rng, path, other)  # an earlier damage left nothing to edit
        case.damages.append(f"{os.path.basename(path)}: {what}")
    for p in ckpts:
        case.damaged[os.path.basename(p)] = snapshot(p) != pristine[os.path.basename(p)]


def _same_load(path: str, pristine_path: str) -> bool:
    """Whether everything a load reads from `path` is bitwise what it reads from the pristine
    copy (step, state, config, every array)."""
    a, b = ck.load_checkpoint(path), ck.load_checkpoint(pristine_path)
    if (a["step"], a["state"], a["config"]) != (b["step"], b["state"], b["config"]):
        return False
    return all(a[k].keys() == b[k].keys() and all(
        np.array_equal(a[k][n].view(np.uint32), b[k][n].view(np.uint32)) for n in a[k])
        for k in ("master", "m", "v"))


def judge(root: str, pristine_root: str, case: Case, cfg, comm=None) -> Case:
    """Resume auto on the damaged `root` (collective over `comm`) against the oracle."""
    logs: list[str] = []
    try:
        took = ck.resolve_resume(CheckpointConfig(dir=root, resume="auto"), "unused", cfg.model,
                                 comm=comm, log=logs.append)
        refusal = None
    except ck.CheckpointError as e:
        took, refusal = None, str(e)
    except Exception as e:  # noqa: BLE001 - exactly what the fuzzer hunts
        case.failure = f"traceback: {type(e).__name__}: {e}"
        return case
    case.took = os.path.basename(took) if took else None
    if comm is not None and comm.Get_rank() != 0:
        return case
    bad_lines = [m for m in logs + [refusal or ""] if "\n" in m]
    if bad_lines:
        case.failure = f"a message of more than one line: {bad_lines[0]!r}"
        return case
    for p in checkpoints(root):
        name = os.path.basename(p)
        pristine = os.path.join(pristine_root, name)
        if took == p:
            try:
                same = case.forged.get(name) and _same_load(p, pristine)
            except Exception as e:  # noqa: BLE001 - taken, then unloadable: a failure
                case.failure = f"took {name}, which then fails to load: {type(e).__name__}: {e}"
                return case
            if case.damaged[name] and not same:
                case.failure = f"resumed from the damaged {name}"
            else:
                case.expect = name
                step = ck.load_checkpoint(p, [], buffers=())["step"]
                fin = finished_message(cfg, p)
                if step != ck.checkpoint_step(p) or ck.read_manifest(p)["step"] != step:
                    case.failure = f"{name}: resumes at step {step}"
                elif fin is not None and f"at step {step} " not in fin:
                    case.failure = f"{name}: the finished verdict names another step: {fin}"
                case.outcome = f"resume {step}"
            return case
        if not case.damaged[name]:
            case.failure = f"skipped the intact {name} (took {case.took}, refusal {refusal!r})"
            return case
    case.outcome = "refuse"
    if took is not None:
        case.failure = f"took {took}, which is none of the checkpoints"
    return case


# -- the trainer's side ----------------------------------------------------------------------


def train(job: str, run_dir: str, *sets: str, n: int = 1, timeout: int = 300):
    """The trainer as a process (`n` ranks under mpirun); the CompletedProcess."""
    cmd = [sys.executable, "-m", "ratrain.train", "--config", job, "--set", f"run.dir={run_dir}"]
    for s in sets:
        cmd += ["--set", s]
    if n > 1:
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        cmd = [mpirun, "--oversubscribe", "-n", str(n), *cmd]
    env = dict(os.environ, PYTHONHASHSEED="0")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)


def final_state(ckpt_path: str) -> dict:
    """What a checkpoint holds for comparison: step, state and every array's bytes."""
    c = ck.load_checkpoint(ckpt_path)
    arrays = {(k, n): c[k][n].tobytes() for k in ("master", "m", "v") for n in c[k]}
    return {"step": c["step"], "state": c["state"], "arrays": arrays}


_BANNER = re.compile(r"steps (\d+)\.\.(\d+)")


def restart(job: str, run_dir: str, case: Case, reference, sets=(), n: int = 1) -> str:
    """Run the trainer on the damaged `run_dir` (resume auto); "" when it did what `case`
    (judged on the same directory) requires: resumed at its checkpoint's step and ended bitwise
    equal to `reference(name)` (a clean resume's final state), or refused with exit 2 in one
    line; else why not."""
    p = train(job, run_dir, "checkpoint.resume=auto", *sets, n=n)
    err = p.stderr
    if "Traceback" in err or "Traceback" in p.stdout:
        return f"traceback (exit {p.returncode}):\n{err[-3000:]}"
    if case.expect is None:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if p.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
            return f"expected a one-line refusal, exit 2; got exit {p.returncode}:\n{err[-3000:]}"
        return ""
    if p.returncode != 0:
        return f"expected a resume from {case.expect}; exit {p.returncode}:\n{err[-3000:]}"
    m = _BANNER.search(p.stdout)
    start = int(m.group(1)) - 1 if m else None
    if start != ck.checkpoint_step(case.expect):
        return f"resumed at step {start}, expected {case.expect}:\n{p.stdout[-2000:]}"
    last = checkpoints(os.path.join(run_dir, "checkpoints"))[0]
    if final_state(last) != reference(case.expect):
        return f"resumed from {case.expect} but ended differently from a clean resume from it"
    return ""


__all__ = ["DAMAGES", "Case", "checkpoints", "damage", "final_state", "judge", "restart",
           "snapshot", "train"]
