"""Platform profiles: shipped values with sources, config overrides, clear errors."""

import pytest

from ratrain.config import PlatformConfig
from ratrain.shim.platform import ProfileError, available_profiles, load_profile, resolve_platform


def test_shipped_profiles_have_every_value_with_a_source():
    assert {"mt3000", "host"} <= set(available_profiles())
    for name in ("mt3000", "host"):
        prof = load_profile(name)
        for key in ("ddr_bytes", "compute_flops", "link_bandwidth", "link_latency"):
            assert key in prof.values and prof.source(key)
        assert prof.time_scale == 1.0 and prof.emulate is False


def test_mt3000_values():
    prof = load_profile("mt3000")
    assert prof.ddr_bytes == 20 * 2**30
    assert "RATrain" in prof.source("ddr_bytes")
    assert prof.compute_flops == pytest.approx(4.5e12)
    assert "assumed" in prof.source("link_bandwidth")
    assert prof.facts["clusters_per_chip"].value == 4
    assert "11.6" in prof.facts["fp64_flops_per_chip"].source
    assert "mt3000" in prof.describe()


def test_host_models_nothing():
    prof = load_profile("host")
    assert prof.ddr_bytes is None and prof.link_bandwidth is None and prof.compute_flops is None


def test_config_overrides_carry_their_source():
    cfg = PlatformConfig(profile="mt3000", link_bandwidth=1e9, ddr_bytes=1 << 30, time_scale=50.0,
                         emulate=True)
    prof = resolve_platform(cfg)
    assert prof.link_bandwidth == 1e9 and prof.source("link_bandwidth") == "config: platform.link_bandwidth"
    assert prof.ddr_bytes == 1 << 30
    assert prof.link_latency == load_profile("mt3000").link_latency  # not overridden
    assert "assumed" in prof.source("link_latency")
    assert prof.time_scale == 50.0 and prof.emulate is True


def test_profile_from_a_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("""
name: mine
values:
  ddr_bytes: {value: 1000, source: me}
  compute_flops: {value: 1e9, source: me}
  link_bandwidth: {value: 1.0e8, source: me}
  link_latency: {value: 1.0e-5, source: me}
""")
    prof = load_profile(str(p))
    assert prof.name == "mine" and prof.ddr_bytes == 1000 and prof.compute_flops == 1e9


def test_bad_profiles_fail_clearly(tmp_path):
    with pytest.raises(ProfileError, match="unknown platform profile 'nope'.*mt3000"):
        load_profile("nope")
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\nvalues:\n  ddr_bytes: {value: 1}\n")
    with pytest.raises(ProfileError, match="ddr_bytes needs"):
        load_profile(str(p))
    with pytest.raises(AttributeError, match="no value"):
        _ = load_profile("host").nonsense
