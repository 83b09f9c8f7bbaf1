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
        ("", ["precision=bf16"], "precision='bf16' is not one of"),
        ("", ["run.trace=maybe"], "run.trace='maybe' must be true or false"),
        ("", ["optim.betas=[0.9]"], "optim.betas"),
        ("", ["parallel.pp=2", "parallel.layers_per_stage=[1,2]"], "sums to 3 but model.layers=4"),
        ("", ["bogus.x=1"], "unknown section 'bogus'"),
        ("", ["optim.lr"], "expected section.key=value"),
        ("- a\n- b\n", [], "top level must be a mapping"),
    ],
)
def test_bad_configs_name_key_and_value(tmp_path, text, overrides, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert needle in str(e.value)
    if not overrides:
        assert str(path) in str(e.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_world_size_mismatch_says_how_to_launch():
    cfg = load_config(None, ["parallel.pp=2", "parallel.dp=2"])
    cfg.check_world(4)
    with pytest.raises(ConfigError, match=r"world size 3 != .*mpirun -n 4"):
        cfg.check_world(3)


def test_num_params_matches_block_spec():
    from ratrain.exec.spec import model_blocks

    for tie in (False, True):
        cfg = load_config(None, [f"model.tie_embeddings={str(tie).lower()}", "model.kv_heads=2"])
        assert cfg.model.num_params() == sum(b.size for b in model_blocks(cfg.model))
