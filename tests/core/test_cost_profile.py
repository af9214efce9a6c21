"""Cost profiles: the interpolated t_target(k), loading from JSON or a bench run, bad files."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from specdec.cost_profile import DEFAULT_PROFILE, CostProfile
from specdec.errors import InvalidRequestError
from specdec.head import AcceptanceHead, HeadConfig, load_head

LLAMA_CPP = {"t_draft_ms": 22, "t_target_ms": {"1": 35, "2": 65, "4": 110, "8": 237, "16": 305}}


def test_t_target_interpolates_the_curve_at_k_plus_one_tokens():
    profile = CostProfile.model_validate(LLAMA_CPP)
    assert profile.t_target(0) == 35 and profile.t_target(1) == 65  # plain decoding; one candidate + 1
    assert profile.t_target(2) == pytest.approx(87.5)  # 3 tokens: halfway from 65 to 110
    assert profile.t_target(19) == pytest.approx(305 + 4 * 68 / 8)  # past 16: the last slope
    assert profile.round_ms(2) == pytest.approx(44 + 87.5)
    assert profile.round_ms(1, draft_steps=2) == pytest.approx(44 + 65)
    assert CostProfile(t_draft_ms=1, t_target_ms={4: 50}).t_target(9) == 50  # one point: flat


def test_load_a_profile_or_a_bench_run(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(LLAMA_CPP))
    assert CostProfile.load(path) == CostProfile.model_validate(LLAMA_CPP)
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"forward_times": {"draft_s": {"1": 0.05, "4": 0.07},
                                                   "target_s": {"1": 0.25, "8": 0.35}}}))
    profile = CostProfile.load(bench)
    assert profile.t_draft_ms == pytest.approx(50) and profile.t_target_ms == pytest.approx({1: 250, 8: 350})
    fitted = {"t_draft_ms": 56.0, "t_target_ms": {"1": 400.0, "21": 860.0}}  # the loop's own costs win
    bench.write_text(json.dumps({"cost_profile": fitted, "forward_times": {"draft_s": {"1": 0.05},
                                                                           "target_s": {"1": 0.25}}}))
    assert CostProfile.load(bench) == CostProfile.model_validate(fitted)


@pytest.mark.parametrize("text", ["{", json.dumps({"t_draft_ms": 1}), json.dumps({**LLAMA_CPP, "t_target_ms": {"0": 5}}),
                                  json.dumps({**LLAMA_CPP, "extra": 1})])
def test_a_bad_profile_is_one_line(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(InvalidRequestError, match="bad cost profile") as info:
        CostProfile.load(path)
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidRequestError, match="cannot read"):
        CostProfile.load(tmp_path / "missing.json")


def test_the_head_carries_a_profile_optionally(tmp_path):
    head = AcceptanceHead(HeadConfig(hidden_size=4, depth=0, draft_identity="x"))
    assert load_head(head.save(tmp_path / "a")).config.cost_profile is None
    head.config.cost_profile = DEFAULT_PROFILE
    assert load_head(head.save(tmp_path / "b")).config.cost_profile == DEFAULT_PROFILE
    with pytest.raises(ValidationError):
        CostProfile(t_draft_ms=-1, t_target_ms={1: 10})
