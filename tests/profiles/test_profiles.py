import pytest

from minicpmo_rt.errors import InputError
from minicpmo_rt.profiles import available_profiles, load_profile, parse_extra_overrides, parse_size


def test_shipped_profiles_match_the_design_table():
    assert {"minicpmo_4_5_turn_mrv2", "minicpmo_4_5_turn_mrv2_h200", "minicpmo_4_5_duplex_h200"} <= set(
        available_profiles())
    g = load_profile("minicpmo_4_5_turn_mrv2")
    h = load_profile("minicpmo_4_5_turn_mrv2_h200.yaml")
    d = load_profile("minicpmo_4_5_duplex_h200")
    assert (g.mode, g.talker.capacity, g.talker.kv_cache_bytes) == ("turn", 8, 2 << 30)
    assert (h.mode, h.talker.capacity, h.talker.kv_cache_bytes) == ("turn", 16, 4 << 30)
    assert d.mode == "duplex"
    for p in (g, h, d):
        assert p.code2wav.extra["token2wav_allow_tf32"] is True
        assert "cfm_fused_body" not in p.code2wav.extra  # auto
        assert p.code2wav.extra["cfm_slot_pool"] is False and p.code2wav.extra["cfm_row_offset_merge"] is False


def test_overrides_and_errors(tmp_path):
    p = load_profile("minicpmo_4_5_turn_mrv2", parse_extra_overrides(["cfm_fused_body=false"]))
    assert p.code2wav.extra["cfm_fused_body"] is False
    with pytest.raises(InputError, match="cfm_typo"):
        load_profile("minicpmo_4_5_turn_mrv2", {"cfm_typo": 1})
    with pytest.raises(InputError, match="not a shipped profile"):
        load_profile("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmode: turn\ntalker: {capacity: 8, kv_cache: lots}\n")
    with pytest.raises(InputError, match="not a size"):
        load_profile(bad)
    assert parse_size("512MiB", "t") == 512 << 20 and parse_size(1024, "t") == 1024
