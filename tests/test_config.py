"""Strict config loading: unknown keys, wrong types and impossible values fail with clear errors."""

import pytest

from ratrain.config import ConfigError, load_config


def write(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides_are_typed(tmp_path):
    cfg = load_config(
        write(tmp_path, "model:\n  hidden: 64\n  heads: 4\n  kv_heads: 2\n"),
        ["optim.lr=1e-3", "optim.betas=[0.8,0.9]", "run.trace=true", "parallel.layers_per_stage=[2,2]",
         "parallel.pp=2"],
    )
    assert cfg.model.hidden == 64 and cfg.model.head_dim == 16
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.run.trace is True
    assert cfg.parallel.layers_per_stage == (2, 2)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(write(tmp_path, "precision: fp16\nschedule:\n  policy: baseline-1f1b\n"))
    again = load_config(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


@pytest.mark.parametrize(
    "text, overrides, needle",
    [
        ("model:\n  hiden: 64\n", [], "unknown key model.hiden"),
        ("modle:\n  hidden: 64\n", [], "unknown key modle"),
        ("model:\n  hidden: sixty\n", [], "model.hidden='sixty' must be an integer"),
        ("model:\n  hidden: 64.5\n", [], "model.hidden=64.5 must be an integer"),
        ("model:\n  hidden: 100\n  heads: 3\n", [], "model.heads=3 does not divide model.hidden=100"),
        ("model:\n  heads: 4\n  kv_heads: 3\n", [], "model.kv_heads=3 does not divide model.heads=4"),
        ("", ["parallel.pp=9"], "parallel.pp=9 is more pipeline stages than model.layers=4"),
        ("", ["parallel.dp=0"], "parallel.dp=0 must be > 0"),
        ("", ["schedule.policy=zero3"], "schedule.policy='zero3' is not one of"),
        ("", ["precision=fp8"], "precision='fp8' is not one of"),
        ("", ["run.trace=maybe"], "run.trace='maybe' must be true or false"),
        ("", ["optim.betas=[0.9]"], "optim.betas"),
        ("", ["parallel.pp=2", "parallel.layers_per_stage=[1,2]"], "sums to 3 but model.layers=4"),
        ("", ["bogus.x=1"], "unknown section 'bogus'"),
        ("", ["optim.lr"], "expected section.key=value"),
        ("- a\n- b\n", [], "top level must be a mapping"),
        ("model:\n  hidden: 64\noptim:\n  lr: 1.0\nmodel:\n  layers: 2\n", [],
         ":5: 'model' appears twice in one mapping (first at line 1)"),
        ("optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", [], ":3: 'lr' appears twice"),
        ("optim:\n  lr: .inf\n", [], "optim.lr=inf must be a finite number"),
        ("", ["optim.lr=.nan"], "optim.lr=nan must be a finite number"),
        ("", ["optim.eps=inf"], "optim.eps='inf' must be a finite number"),
        ("", ["optim.max_nonfinite_steps=-1"], "optim.max_nonfinite_steps=-1 must be >= 0"),
        ("", ["checkpoint.on_error=ignore"], "checkpoint.on_error='ignore' is not one of"),
        ("", ["comm.timeout=0.5"], "comm.timeout=0.5 must be 0 (off) or >= 1 second"),
        ("", ["run.stop_signals=[KILL]"], "run.stop_signals: 'KILL' is not one of"),
        ("", ["run.time_limit=-1"], "run.time_limit=-1.0 must be >= 0"),
        ("", ["run.name=a/b"], "run.name='a/b' must be a plain name"),
    ],
)
def test_bad_configs_name_key_and_value(tmp_path, text, overrides, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert needle in str(e.value)
    if not overrides:
        assert str(path) in str(e.value)


def test_new_keys_defaults_and_forms():
    cfg = load_config(None, ["run.name=exp1", "run.time_limit=1:30:00", "run.stop_signals=USR1,TERM"])
    assert cfg.run.dir == "runs/exp1" and cfg.run.time_limit == 5400.0
    assert cfg.run.stop_signals == ("USR1", "TERM")
    assert load_config(None).run.dir == "runs/default"
    assert load_config(None, ["run.name=x", "run.dir=elsewhere"]).run.dir == "elsewhere"
    assert load_config(None).optim.nonfinite_limit("fp32") == 1
    assert load_config(None).optim.nonfinite_limit("fp16") == 20
    assert load_config(None, ["optim.max_nonfinite_steps=3"]).optim.nonfinite_limit("fp32") == 3
    c = load_config(None, ["comm.timeout=30", "checkpoint.on_error=continue"])
    assert c.comm.timeout == 30.0 and c.checkpoint.on_error == "continue"


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_world_size_mismatch_says_how_to_launch():
    cfg = load_config(None, ["parallel.pp=2", "parallel.dp=2"])
    cfg.check_world(4)
    with pytest.raises(ConfigError, match=r"world size 3 != .*mpirun -n 4"):
        cfg.check_world(3)


def test_world_of_one_under_srun_names_the_plugin(monkeypatch):
    cfg = load_config(None, ["parallel.pp=2", "parallel.dp=2"])
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(ConfigError, match=r"srun started 4 tasks.*srun --mpi=pmix.*mpirun"):
        cfg.check_world(1)


def test_num_params_matches_block_spec():
    from ratrain.exec.spec import model_blocks

    for tie in (False, True):
        cfg = load_config(None, [f"model.tie_embeddings={str(tie).lower()}", "model.kv_heads=2"])
        assert cfg.model.num_params() == sum(b.size for b in model_blocks(cfg.model))


def test_switch_variables_override_the_file_and_set_overrides_both(monkeypatch):
    from ratrain.config.switches import SWITCHES

    for s in SWITCHES:
        monkeypatch.delenv(s.env, raising=False)
    assert load_config("jobs/tiny.yaml").run.fused == "auto"
    monkeypatch.setenv("RATRAIN_FUSED", "0")
    monkeypatch.setenv("RATRAIN_LOG_MESSAGES", "1")
    cfg = load_config("jobs/tiny.yaml")
    assert (cfg.run.fused, cfg.comm.log_messages) == ("off", True)
    assert "fused: 'off'" in cfg.to_yaml()  # recorded in the run's config.yaml
    assert load_config("jobs/tiny.yaml", ["run.fused=auto"]).run.fused == "auto"
    monkeypatch.setenv("RATRAIN_DEVKERNELS", "sometimes")
    with pytest.raises(ConfigError, match=r"^RATRAIN_DEVKERNELS='sometimes' is not one of .*"
                                          r"overrides run.devkernels"):
        load_config("jobs/tiny.yaml")


def test_yaml_on_off_are_the_words():
    cfg = load_config(None, ["run.fused=off", "run.devkernels=on"])  # YAML: False, True
    assert (cfg.run.fused, cfg.run.devkernels) == ("off", "on")
    with pytest.raises(ConfigError, match=r"run.fused='fast' is not one of: auto, on, off"):
        load_config(None, ["run.fused=fast"])


def test_readme_lists_every_switch():
    from pathlib import Path

    from ratrain.config.switches import table

    assert table() in (Path(__file__).parents[1] / "README.md").read_text()


def test_readme_names_every_ratrain_variable_of_the_repository():
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    names = set()
    for f in files:
        if f.endswith((".py", ".sh", ".sbatch", ".cfg", ".yaml")) or f.startswith("slurm/"):
            p = root / f
            if p.is_file():
                names |= set(re.findall(r"RATRAIN_[A-Z0-9_]*[A-Z0-9]", p.read_text(errors="replace")))
    readme = (root / "README.md").read_text()
    assert names and not sorted(n for n in names if f"`{n}`" not in readme)
