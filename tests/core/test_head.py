"""The acceptance head: shapes for every depth, save/load, and the errors of a wrong or broken head."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from specdec.errors import IncompatibleModelsError, ModelSourceError
from specdec.head import (CONFIG_FILE, MAX_DEPTH, WEIGHTS_FILE, AcceptanceHead, HeadConfig, ValidatedDraft,
                          load_head)

HIDDEN = 12
IDENTITY = "a" * 64


def make_head(depth: int = 2, seed: int = 0, identity: str = IDENTITY) -> AcceptanceHead:
    torch.manual_seed(seed)
    return AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=depth, draft_identity=identity,
                                     draft_name="tiny-draft")).eval()


@pytest.fixture
def saved(tmp_path) -> tuple[AcceptanceHead, object]:
    head = make_head()
    return head, head.save(tmp_path / "head")


@pytest.mark.parametrize("depth", range(MAX_DEPTH + 1))
def test_shapes_for_every_depth(depth):
    head = make_head(depth)
    assert len(head.blocks) == depth
    # D residual blocks (W, b each) and the output layer
    assert sum(p.numel() for p in head.parameters()) == depth * (HIDDEN * HIDDEN + HIDDEN) + HIDDEN + 1
    assert head(torch.randn(3, 5, HIDDEN)).shape == (3, 5)
    assert head(torch.randn(HIDDEN)).shape == ()
    probs = head.acceptance_probability(torch.randn(7, HIDDEN))
    assert probs.shape == (7,) and ((probs > 0) & (probs < 1)).all()


def test_depth_outside_the_paper_sweep_is_rejected():
    for depth in (-1, MAX_DEPTH + 1):
        with pytest.raises(ValidationError):
            HeadConfig(hidden_size=HIDDEN, depth=depth, draft_identity=IDENTITY)


def test_reads_half_precision_hidden_states():
    head = make_head()
    hidden = torch.randn(4, HIDDEN)
    torch.testing.assert_close(head(hidden.to(torch.bfloat16)), head(hidden.to(torch.bfloat16).float()))


def test_residual_block_is_x_plus_silu():
    head = make_head(depth=1)
    x = torch.randn(HIDDEN)
    block = head.blocks[0]
    expected = x + torch.nn.functional.silu(block.linear.weight @ x + block.linear.bias)
    torch.testing.assert_close(block(x), expected)


def test_input_is_standardised_with_the_training_statistics():
    head = make_head(depth=0)
    features = torch.randn(1000, HIDDEN, dtype=torch.float64) * torch.linspace(0.5, 3, HIDDEN) + 7
    features[:, 0] = 150.0  # a constant "massive" dimension: centred, not divided by ~0
    head.fit_input_statistics(features.to(torch.bfloat16), chunk=64)  # chunks sum to the whole
    mean, std = features.to(torch.bfloat16).double().mean(0), features.to(torch.bfloat16).double().std(0, correction=0)
    torch.testing.assert_close(head.input_mean, mean.float())
    torch.testing.assert_close(head.input_std[1:], std[1:].float())
    assert head.input_std[0] == pytest.approx(1e-3)
    x = torch.randn(5, HIDDEN)
    expected = head.out.weight @ ((x - head.input_mean) / head.input_std).T + head.out.bias
    torch.testing.assert_close(head(x), expected.squeeze(0))


def test_saved_head_keeps_its_input_statistics(tmp_path):
    head = make_head()
    head.fit_input_statistics(torch.randn(50, HIDDEN) * 4 + 2)
    loaded = load_head(head.save(tmp_path / "head"))
    assert torch.equal(loaded.input_mean, head.input_mean) and torch.equal(loaded.input_std, head.input_std)
    hidden = torch.randn(3, HIDDEN)
    assert torch.equal(loaded(hidden), head(hidden))


def test_save_load_round_trip_gives_identical_outputs(saved):
    head, directory = saved
    assert (directory / WEIGHTS_FILE).is_file() and (directory / CONFIG_FILE).is_file()
    loaded = load_head(directory, draft_identity=IDENTITY, hidden_size=HIDDEN)
    assert loaded.config == head.config
    assert not loaded.training
    hidden = torch.randn(6, HIDDEN)
    assert torch.equal(loaded(hidden), head(hidden))
    assert torch.equal(load_head(directory)(hidden), head(hidden))  # no checks asked for


def test_load_for_another_draft_is_incompatible(saved):
    _, directory = saved
    with pytest.raises(IncompatibleModelsError, match="another draft") as info:
        load_head(directory, draft_identity="b" * 64, hidden_size=HIDDEN)
    assert "\n" not in str(info.value)


def test_a_draft_validated_for_the_head_loads_it_and_no_other(tmp_path):
    head = make_head(identity="gguf-sha256:" + "a" * 64)
    other = "gguf-sha256:" + "a" * 64 + "+q4_0"
    head.config.validated_drafts = [ValidatedDraft(identity=other, tokens=10, auroc=0.87, ece=0.01,
                                                   reference_auroc=0.87, reference_ece=0.005)]
    directory = head.save(tmp_path / "head")
    assert load_head(directory, draft_identity=other, hidden_size=HIDDEN).config.serves(other)
    with pytest.raises(IncompatibleModelsError, match=r"aaaaaaaaaaaa\), not this one \(aaaaaaaaaaaa\+iq4_nl\)"):
        load_head(directory, draft_identity="gguf-sha256:" + "a" * 64 + "+iq4_nl", hidden_size=HIDDEN)


def test_load_with_wrong_hidden_size_is_incompatible(saved):
    _, directory = saved
    with pytest.raises(IncompatibleModelsError, match="hidden size") as info:
        load_head(directory, draft_identity=IDENTITY, hidden_size=HIDDEN * 2)
    assert "\n" not in str(info.value)


def test_missing_directory_or_file_is_a_source_error(tmp_path, saved):
    with pytest.raises(ModelSourceError, match="no acceptance head"):
        load_head(tmp_path / "nowhere")
    _, directory = saved
    (directory / WEIGHTS_FILE).unlink()
    with pytest.raises(ModelSourceError, match="no acceptance head"):
        load_head(directory)


@pytest.mark.parametrize("text", [
    "{not json",
    "[1, 2]",
    json.dumps({"hidden_size": HIDDEN, "depth": 2}),  # no draft identity
    json.dumps({"hidden_size": HIDDEN, "depth": 9, "draft_identity": IDENTITY}),
])
def test_corrupt_config_is_a_source_error(saved, text):
    _, directory = saved
    (directory / CONFIG_FILE).write_text(text)
    with pytest.raises(ModelSourceError, match="corrupt head config") as info:
        load_head(directory)
    assert not isinstance(info.value, IncompatibleModelsError)
    assert "\n" not in str(info.value)


def test_truncated_weights_are_a_source_error(saved):
    _, directory = saved
    weights = directory / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelSourceError, match="corrupt head weights") as info:
        load_head(directory, draft_identity=IDENTITY, hidden_size=HIDDEN)
    assert "\n" not in str(info.value)


def test_a_save_cut_short_leaves_the_head_it_replaces(saved, monkeypatch):
    """Found by a bug hunt: a run killed between writing a head's weights and its config left the
    new weights beside the old config (its calibration), loaded without a word."""
    head, directory = saved
    before = {name: (directory / name).read_bytes() for name in (WEIGHTS_FILE, CONFIG_FILE)}
    retrained = make_head(seed=1)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(HeadConfig, "model_dump_json", killed)
    with pytest.raises(KeyboardInterrupt):
        retrained.save(directory)
    assert {name: (directory / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in directory.iterdir()) == sorted(before)  # nothing half written left


def test_weights_of_another_depth_are_a_source_error(tmp_path):
    directory = make_head(depth=1).save(tmp_path / "head")
    config = json.loads((directory / CONFIG_FILE).read_text())
    (directory / CONFIG_FILE).write_text(json.dumps({**config, "depth": 3}))
    with pytest.raises(ModelSourceError, match="corrupt head weights") as info:
        load_head(directory)
    assert "\n" not in str(info.value)


def test_the_chosen_threshold_is_saved_and_loaded(tmp_path):
    head = make_head()
    head.config.threshold = 0.3
    assert load_head(head.save(tmp_path / "head")).config.threshold == 0.3
    with pytest.raises(ValidationError):
        HeadConfig(hidden_size=HIDDEN, depth=0, draft_identity=IDENTITY, threshold=1.5)


def test_auto_is_the_head_shipped_for_the_default_draft_only(tmp_path, monkeypatch):
    from specdec import heads

    shipped = make_head().save(tmp_path / "default-pair")
    monkeypatch.setitem(heads.SHIPPED, "default", shipped)
    assert heads.resolve_head("auto", "default") == str(shipped)
    assert heads.resolve_head("auto", "/some/other/draft") is None
    assert heads.resolve_head("none", "default") is None
    assert heads.resolve_head(None, "default") is None
    assert heads.resolve_head("/a/head", "default") == "/a/head"
    monkeypatch.setitem(heads.SHIPPED, "default", tmp_path / "missing")
    assert heads.resolve_head("auto", "default") is None  # a checkout without the shipped head


def test_the_shipped_default_pair_head_loads_with_its_threshold():
    from specdec import heads

    directory = heads.resolve_head("auto", "default")
    assert directory == str(heads.SHIPPED["default"])
    head = load_head(directory, hidden_size=896)  # the draft's identity: tests/test_default_pair.py
    assert head.config.threshold is not None and 0 < head.config.threshold < 1
    assert head.config.input_size == len(head.input_std)
    assert (head.input_std > 0).all() and not torch.equal(head.input_std, torch.ones_like(head.input_std))  # trained
    report = json.loads((heads.SHIPPED["default"] / "training.json").read_text())
    assert report["train"]["depth"] == head.config.depth and report["train"]["features"] == head.config.features
    assert head.config.calibration is not None and set(report["by_temperature"]) == {"0", "1"}


def test_a_bottleneck_projects_only_the_hidden_state(tmp_path):
    from specdec.features import FEATURES_DISTRIBUTION, NUM_SCALAR_FEATURES

    torch.manual_seed(0)
    config = HeadConfig(hidden_size=HIDDEN, depth=2, draft_identity=IDENTITY, features=FEATURES_DISTRIBUTION,
                        bottleneck=4, dropout=0.5)
    head = AcceptanceHead(config)
    assert config.block_width == 4 + NUM_SCALAR_FEATURES
    assert head.project.weight.shape == (4, HIDDEN) and head.out.weight.shape == (1, 4 + NUM_SCALAR_FEATURES)
    inputs = torch.randn(7, HIDDEN + NUM_SCALAR_FEATURES)
    head.eval()  # dropout off: deterministic
    torch.testing.assert_close(head(inputs), head(inputs))
    # the scalars reach the blocks unprojected: changing one moves the logit though the hidden part is fixed
    moved = inputs.clone()
    moved[:, -1] += 1.0
    assert not torch.allclose(head(moved), head(inputs))
    head.save(tmp_path)
    loaded = load_head(tmp_path, draft_identity=IDENTITY)
    assert loaded.config.bottleneck == 4 and loaded.config.dropout == 0.5
    torch.testing.assert_close(loaded(inputs), head(inputs))


def test_dropout_acts_in_training_only():
    config = HeadConfig(hidden_size=HIDDEN, depth=1, draft_identity=IDENTITY, dropout=0.9)
    head = AcceptanceHead(config)
    inputs = torch.randn(64, HIDDEN)
    head.train()
    assert not torch.allclose(head(inputs), head(inputs))
    head.eval()
    torch.testing.assert_close(head(inputs), head(inputs))
