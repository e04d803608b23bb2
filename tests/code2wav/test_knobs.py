import itertools

import pytest
import torch

from minicpmo_rt.code2wav.knobs import DeviceFacts, TF32_ENV, device_facts, resolve_code2wav
from minicpmo_rt.errors import InputError

FUSED = [None, True, False]            # cfm_fused_body: unset, true, false
ALLOW = [None, True, False]            # token2wav_allow_tf32: unset, true, false
ENV = [None, "off", "OFF", "on"]       # MINICPMO_CODE2WAV_TF32
DEVICES = {
    "cpu": DeviceFacts(cuda=False),
    "sm70": DeviceFacts(cuda=True, sm_major=7),
    "sm80": DeviceFacts(cuda=True, sm_major=8),
    "sm90": DeviceFacts(cuda=True, sm_major=9),
    "hip": DeviceFacts(cuda=True, sm_major=9, hip=True),
}
LAYOUT = [True, False]
CACHE = [torch.float32, torch.bfloat16]


def expected(fused, allow, env, dev: DeviceFacts, layout, cache):
    """The seed's rules, stated case by case."""
    tf32_allowed = not (env is not None and env.lower() == "off") and allow is not False
    eligible = layout and cache == torch.float32
    if fused is False:
        body = "original"
    elif fused is True:
        body = "fused" if eligible else "original"
    else:  # auto
        body = "fused" if (dev.cuda and tf32_allowed and eligible) else "original"
    if body == "original":
        attention = None
    elif dev.cuda and not dev.hip and dev.sm_major >= 8:
        attention = "triton-tf32"
    else:
        attention = "sdpa"
    return body, attention, tf32_allowed and dev.cuda


@pytest.mark.parametrize("fused,allow,env,dev,layout,cache",
                         list(itertools.product(FUSED, ALLOW, ENV, DEVICES, LAYOUT, CACHE)))
def test_every_combination(fused, allow, env, dev, layout, cache):
    extra = {}
    if fused is not None:
        extra["cfm_fused_body"] = fused
    if allow is not None:
        extra["token2wav_allow_tf32"] = allow
    environ = {} if env is None else {TF32_ENV: env}
    facts = DeviceFacts(**{**DEVICES[dev].__dict__, "layout_supported": layout, "att_cache_dtype": cache})
    choice = resolve_code2wav(extra, facts, environ)
    assert (choice.body, choice.attention, choice.tf32) == expected(fused, allow, env, DEVICES[dev], layout, cache)
    text = choice.describe()
    assert choice.body in text and ("on" if choice.tf32 else "off") in text and choice.reason
    # the persistent DiT kernel is named exactly when FusedDiT's default would take it (TF32 attention + TF32)
    assert ("persistent" in text) == (choice.body == "fused" and choice.attention == "triton-tf32" and choice.tf32)
    # so are the many-row Triton tile GEMMs (FusedDiT's wide_gemm default: TF32 on)
    assert ("tile GEMMs" in text) == (choice.body == "fused" and choice.tf32)
    # and the direct solves (each stream's cache read in place), which need the Triton attention
    assert ("read in place" in text) == (choice.body == "fused" and choice.attention not in (None, "sdpa"))


def test_env_off_wins_over_explicit_allow():
    c = resolve_code2wav({"token2wav_allow_tf32": True}, DEVICES["sm90"], {TF32_ENV: "off"})
    assert not c.tf32 and c.body == "original" and TF32_ENV in c.reason


def test_explicit_true_overrides_disabled_tf32_and_may_use_tf32_attention():
    c = resolve_code2wav({"cfm_fused_body": True, "token2wav_allow_tf32": False}, DEVICES["sm90"], {})
    assert (c.body, c.attention, c.tf32) == ("fused", "triton-tf32", False)


def test_legacy_key_is_lowest_precedence():
    assert not resolve_code2wav({"code2wav_allow_tf32": False}, DEVICES["sm90"], {}).tf32
    assert resolve_code2wav({"code2wav_allow_tf32": "flow"}, DEVICES["sm90"], {}).tf32
    assert resolve_code2wav({"code2wav_allow_tf32": False, "token2wav_allow_tf32": True}, DEVICES["sm90"], {}).tf32


def test_string_values_from_yaml():
    c = resolve_code2wav({"cfm_fused_body": "false", "token2wav_allow_tf32": "true"}, DEVICES["sm90"], {})
    assert (c.body, c.tf32) == ("original", True)


@pytest.mark.parametrize("extra,env", [({"cfm_fused_body": "maybe"}, {}), ({"token2wav_allow_tf32": 3}, {}),
                                       ({}, {TF32_ENV: "sometimes"})])
def test_bad_values_name_the_input(extra, env):
    with pytest.raises(InputError) as exc:
        resolve_code2wav(extra, DEVICES["sm90"], env)
    key = next(iter(extra), TF32_ENV)
    assert key in str(exc.value)


@pytest.mark.parametrize("fit", [None, True, False])
@pytest.mark.parametrize("ask", [None, "true", "false"])
def test_fp16_operands_by_knob_and_range_certificate(ask, fit):
    """``cfm_fp16_operands`` over every body / TF32 / device case: FP16 GEMM operands only where the fused body
    runs Triton TF32 attention with TF32 on (its GEMMs are Triton ones); there ``true`` forces them, ``false``
    refuses them and unset takes them exactly when the weights' range certificate fits (``fit``; None: not
    checked, as ``inspect`` without weights). A forced FP16 past a failed certificate says so; ``true`` where
    the path does not apply is ignored, and the reason says so."""
    for fused, allow, env, dev in itertools.product(FUSED, ALLOW, ENV, DEVICES):
        extra = {} if ask is None else {"cfm_fp16_operands": ask}
        if fused is not None:
            extra["cfm_fused_body"] = fused
        if allow is not None:
            extra["token2wav_allow_tf32"] = allow
        facts = DeviceFacts(**{**DEVICES[dev].__dict__, "operands_fit_fp16": fit})
        c = resolve_code2wav(extra, facts, {} if env is None else {TF32_ENV: env})
        tf32_on = not (env is not None and env.lower() == "off") and allow is not False
        # stated from the inputs: SM80+ NVIDIA, TF32 on, and the fused body (auto picks it when TF32 is on)
        path = dev in ("sm80", "sm90") and tf32_on and fused is not False
        assert path == (c.body == "fused" and c.tf32 and c.attention == "triton-tf32")
        fp16 = path and (ask == "true" or (ask is None and fit is True))
        assert c.gemm_operands == ("fp16" if fp16 else "fp32"), (fused, allow, env, dev)
        assert ("operands FP16" in c.describe()) == fp16
        assert ("proj, conv, fc1, fc2 as cuBLAS FP16 GEMMs" in c.describe()) == fp16
        assert ("cfm_fp16_operands ignored" in c.reason) == (ask == "true" and not path)
        assert ("saturate" in c.reason) == (path and ask == "true" and fit is False)
        assert ("range certificate" in c.reason) == (path and (ask is None or (ask == "true" and fit is False)))


def test_fp16_operands_bad_value_names_the_key():
    with pytest.raises(InputError, match="cfm_fp16_operands"):
        resolve_code2wav({"cfm_fp16_operands": "half"}, DEVICES["sm90"], {})


def test_device_facts_cpu():
    f = device_facts("cpu")
    assert not f.cuda and f.att_cache_dtype == torch.float32


def test_graph_budget_and_precapture_knobs():
    """``cfm_max_graphs`` (default 32, 0 = eager) and ``cfm_graph_precapture`` (default on): accepted spellings
    and named errors for the rest."""
    from minicpmo_rt.code2wav.knobs import DEFAULT_MAX_GRAPHS, graph_budget, graph_precapture

    assert DEFAULT_MAX_GRAPHS == 32
    assert [graph_budget(e) for e in (None, {}, {"cfm_max_graphs": None}, {"cfm_max_graphs": 128},
                                      {"cfm_max_graphs": "64"}, {"cfm_max_graphs": 0}, {"cfm_max_graphs": 8.0},
                                      {"cfm_max_graphs": "unset"})] == [32, 32, 32, 128, 64, 0, 8, 32]
    for bad in (-1, "many", 2.5, True, "-3"):
        with pytest.raises(InputError, match="cfm_max_graphs"):
            graph_budget({"cfm_max_graphs": bad})
    assert [graph_precapture(e) for e in (None, {}, {"cfm_graph_precapture": True}, {"cfm_graph_precapture": "off"},
                                          {"cfm_graph_precapture": False}, {"cfm_graph_precapture": "auto"})] == [
        True, True, True, False, False, True]
    with pytest.raises(InputError, match="cfm_graph_precapture"):
        graph_precapture({"cfm_graph_precapture": "sometimes"})


def test_hift_carry_knob():
    """``hift_carry`` (opt-in, default off): accepted spellings, and a named error for the rest."""
    from minicpmo_rt.code2wav.knobs import hift_carry

    assert [hift_carry(e) for e in (None, {}, {"hift_carry": True}, {"hift_carry": "on"}, {"hift_carry": "false"},
                                    {"hift_carry": "auto"})] == [False, False, True, True, False, False]
    with pytest.raises(InputError, match="hift_carry"):
        hift_carry({"hift_carry": "sometimes"})


def test_cfm_join_starts_knob():
    """``cfm_join_starts`` (opt-in, default off): accepted spellings, and a named error for the rest."""
    from minicpmo_rt.code2wav.knobs import cfm_join_starts

    assert [cfm_join_starts(e) for e in (None, {}, {"cfm_join_starts": True}, {"cfm_join_starts": "on"},
                                         {"cfm_join_starts": "false"})] == [False, False, True, True, False]
    with pytest.raises(InputError, match="cfm_join_starts"):
        cfm_join_starts({"cfm_join_starts": "sometimes"})
