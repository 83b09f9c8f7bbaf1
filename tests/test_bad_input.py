"""Every bad input of `python -m ratrain.train` is one line, exit 2, before any work, nothing
written: a directory or a non-UTF-8 file as --config, YAML syntax (line, column and the fix), an
empty config, bad keys, values and --set, missing data or checkpoints, an unwritable run.dir, an
attention backend nobody registered, a BLAS that cannot run;
the config cases also under --dry-run and --print-config."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ratrain.data import write_tokens

JOB = ("model: {vocab_size: 64, hidden: 32, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 64, "
       "seq_len: 16}\nparallel: {micro_batch: 2, num_micro_batches: 2}\n"
       "run: {steps: 2, threads: 1}\ndata: {tokens: TOKENS, eval_interval: 0}\n")

# name -> (config text or bytes, or a callable making the --config path; extra --set; the
# words the line must hold; whether the case is about the config file itself)
CASES = {
    "directory": (lambda d: d / "confdir", [], ["is a directory", "give a YAML file"], True),
    "not utf-8": (b"model: {hidden: 32}\n# \xff\xfe caf\xe9\n", [], ["not UTF-8", "line 2"], True),
    "yaml syntax": ("model: {hidden: 32\nrun: {steps: 2}\n", [], ["line 2, column", "not valid YAML"],
                    True),
    "tab indent": ("model:\n\thidden: 32\n", [], ["line 2, column 1", "tab", "spaces"], True),
    "empty": ("# nothing here\n", [], ["is empty", "jobs/tiny.yaml"], True),
    "missing file": (lambda d: d / "nope.yaml", [], ["does not exist"], True),
    "not a mapping": ("- a\n- b\n", [], ["top level must be a mapping"], True),
    "unknown key": (JOB + "optim: {lrr: 1}\n", [], ["lrr"], True),
    "wrong type": (JOB, ["run.steps=many"], ["run.steps='many' must be an integer"], True),
    "bad --set": (JOB, ["optim.lr"], ["expected section.key=value"], True),
    "unknown section": (JOB, ["nope.x=1"], ["unknown section 'nope'"], True),
    "missing tokens": (JOB.replace("TOKENS", "/nonexistent/train.bin"), [], ["/nonexistent/train.bin"],
                       False),
    "world size": (JOB, ["parallel.pp=2"], ["world size 1"], False),
    "missing resume": (JOB, ["checkpoint.resume=/nonexistent/ckpt-000004"],
                       ["/nonexistent/ckpt-000004"], False),
    "read-only run.dir": (JOB, ["run.dir=RO/run"], ["cannot write run.dir=RO/run", "set run.dir"],
                          False),
    "run.dir is a file": (JOB, ["run.dir=FILE"], ["run.dir", "FILE"], False),
    "unknown attention": (JOB, ["run.attention=nope"],
                          ["run.attention='nope' is not a registered", "tiled-64"], False),
    "unknown reference op": (JOB, ["run.reference_ops=[rope,softmax]"],
                             ["run.reference_ops: 'softmax' is not an op", "rmsnorm"], False),
    "negative head chunk": (JOB, ["run.head_chunk_mib=-16"],
                            ["run.head_chunk_mib=-16 must be >= 0", "gpu 256"], True),
    "unknown blas": (JOB, ["run.blas=acml"], ["run.blas='acml' is not one of", "openblas"], True),
    "blas on a device": (JOB, ["run.device=standin", "run.blas=mkl"],
                         ["run.blas=mkl is a host's BLAS", "set run.blas=auto"], False),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    write_tokens(d / "train.bin", np.random.default_rng(0).integers(0, 64, 4000), vocab_size=64)
    (d / "confdir").mkdir()
    (d / "afile").write_text("x")
    ro = d / "ro"
    ro.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)]).returncode == 0
    if not mounted:
        ro.chmod(0o555)  # not root: the permissions refuse
    yield d
    if mounted:
        subprocess.run(["umount", "-l", str(ro)])


ALSO = {"directory", "not utf-8", "yaml syntax"}  # also under --print-config and --dry-run


def _cases():
    for name, (_, _, _, is_config) in CASES.items():
        modes = [""] + (["--print-config", "--dry-run"] if name in ALSO else
                        [] if is_config else ["--dry-run"])
        for mode in modes:
            yield pytest.param(name, mode, id=f"{name}{' ' + mode if mode else ''}")


@pytest.mark.parametrize("name,mode", list(_cases()))
def test_bad_input_is_one_line_exit_2_nothing_written(work, name, mode):
    text, sets, words, _ = CASES[name]
    case = work / name.replace(" ", "_").replace(".", "_")
    case.mkdir(exist_ok=True)
    if callable(text):
        config = text(work)
    else:
        config = case / "job.yaml"
        raw = text if isinstance(text, bytes) else text.replace("TOKENS", str(work / "train.bin"))
        config.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    before = sorted(p.name for p in case.iterdir())
    def fill(x):
        return x.replace("FILE", str(work / "afile")).replace("RO", str(work / "ro"))

    sets, words = [fill(s) for s in sets], [fill(w) for w in words]
    cmd = [sys.executable, "-m", "ratrain.train", "--config", str(config),
           "--set", f"run.dir={case / 'run'}"] + [a for s in sets for a in ("--set", s)]
    if mode:
        cmd.append(mode)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=case)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    for w in words:
        assert w in p.stderr, (w, p.stderr)
    assert sorted(x.name for x in case.iterdir()) == before  # nothing written
    assert (work / "afile").read_text() == "x"


def test_a_launcher_prints_the_line_on_rank_0_only(work):
    env = dict(os.environ, OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2")
    p = subprocess.run([sys.executable, "-m", "ratrain.train", "--config", str(work / "confdir"),
                        "--print-config"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and p.stderr == "" and p.stdout == ""
