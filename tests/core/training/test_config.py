"""The pipeline's YAML config: shipped examples load, unknown keys and impossible values are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specdec.training.config import ConfigError, load_config, parse_config

SHIPPED = sorted((Path(__file__).parents[3] / "cluster" / "training").glob("*.yaml"))
MINIMAL = {"data": {"dir": "d"}, "train": {"storage": "s", "output": "o"}}


def with_change(section: str, key: str, value) -> dict:
    raw = {k: dict(v) for k, v in MINIMAL.items()}
    raw.setdefault(section, {})[key] = value
    return raw


REPLAY_CONFIG = "default-feature-replay.yaml"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = load_config(path)
    assert config.data.prompts.source[:2] == ["stdlib-docstrings", "prose"]  # (the feature draft's adds packages)
    if path.name == REPLAY_CONFIG:  # the feature draft's validation split alone, for the replay: it trains nothing
        draft = load_config(path.parent / "feature-draft.yaml")
        same = {"train": draft.data.prompts.train, "source": draft.data.prompts.source}
        assert config.data.prompts.model_copy(update=same) == draft.data.prompts  # each source splits alone
        assert (config.data.response, config.data.seed) == (draft.data.response, draft.data.seed)
        assert config.data.features.layers == draft.data.features.layers
        assert Path(config.require_draft().output) == Path("specdec/drafts/default-feature")
        assert not config.train.output.startswith("specdec/")  # never the shipped head
    elif config.data.kind == "features":  # the feature draft's, and its head's, kept in the draft's directory
        assert config.train.output == str(Path(config.require_draft().output) / "head")
    else:
        assert config.train is not None


def test_the_feature_draft_config_reuses_the_heads_responses():
    """`--reuse-responses data/default-pair` needs the same response settings (references aside), seed
    and prompt limit; the feature draft's prompts are the head's and more: train prompts of each source
    and a source of its own after the head's."""
    draft, head = (load_config(SHIPPED[0].parent / name) for name in ("feature-draft.yaml", "default-pair.yaml"))
    assert draft.data.response.model_copy(update={"reference": False}) == head.data.response
    assert draft.data.seed == head.data.seed
    same = {"train": head.data.prompts.train, "source": head.data.prompts.source}
    assert draft.data.prompts.model_copy(update=same) == head.data.prompts
    assert draft.data.prompts.source[:len(head.data.prompts.source)] == head.data.prompts.source
    assert draft.data.prompts.train is None or draft.data.prompts.train >= head.data.prompts.train


def test_a_draft_section_needs_features_data():
    config = parse_config({"data": {"dir": "d"}, "draft": {"storage": "s", "output": "o"}})
    with pytest.raises(ConfigError, match="data.kind must be `features`"):
        config.require_draft()
    with pytest.raises(ConfigError, match="layers: .*increasing order"):
        parse_config({"data": {"dir": "d", "kind": "features", "features": {"layers": [3, 1]}}})


def test_gpu_config_differs_only_in_scaling():
    cpu, gpu = (yaml.safe_load((SHIPPED[0].parent / name).read_text()) for name in ("default-pair.yaml", "gpu.yaml"))
    assert {k for k in cpu if cpu[k] != gpu.get(k)} == {"scaling"}
    assert load_config(SHIPPED[0].parent / "gpu.yaml").scaling.use_gpu


def test_label_sets_one_greedy_and_draws_per_sampled_temperature():
    labels = parse_config({"data": {"dir": "d", "labels": {"temperatures": [0.0, 1.0, 0.7], "draws": 2}}}).data.labels
    assert [s.temperature for s in labels.sets()] == [0.0, 1.0, 1.0, 0.7, 0.7]


def test_defaults_follow_the_paper():
    config = parse_config(MINIMAL)
    assert (config.train.depth, config.train.w_acc, config.train.w_rej, config.train.mixing_ratio) == (3, 1.0, 6.0, 0.15)
    assert config.sweep.depths == [0, 1, 2, 3, 4] and config.sweep.w_rej == [1.0, 3.0, 6.0, 12.0]


@pytest.mark.parametrize("raw, message", [
    (with_change("train", "bogus", 1), "train.bogus: unknown key"),
    ({**MINIMAL, "extra_section": {}}, "extra_section: unknown key"),
    (with_change("train", "depth", 5), "train.depth: Input should be less than or equal to 4"),
    (with_change("train", "w_rej", -1), "train.w_rej"),
    (with_change("train", "mixing_ratio", 1.0), "train.mixing_ratio"),
    (with_change("train", "lr", float("nan")), "train.lr"),
    (with_change("scaling", "num_workers", 0), "scaling.num_workers"),
    (with_change("data", "shard_size", 0), "data.shard_size"),
    (with_change("sweep", "depths", [0, 7]), "sweep.depths: each depth must lie in 0..4"),
    (with_change("sweep", "w_rej", [0]), "sweep.w_rej"),
    (with_change("sweep", "select_by", "accuracy"), "sweep.select_by"),
    ({"data": {"dir": "d", "response": {"policy": "specdec++"}}}, "data.response.policy"),
    ({"data": {"dir": "d", "prompts": {"validation_fraction": 0}}}, "data.prompts.validation_fraction"),
    ({"train": {"storage": "s", "output": "o"}}, "data: Field required"),
    ({"data": {"dir": "d"}, "models": {"draft_format": "int8"}},
     "models.draft_format: must be fp32 or onednn: int8 scales a whole teacher-forced pass at once"),
    ({"data": {"dir": "d", "labels": {"temperatures": [1.0, 1.0]}}}, "data.labels.temperatures: must be distinct"),
    ({"data": {"dir": "d", "labels": {"draws": 0}}}, "data.labels.draws"),
    ({"data": {"dir": "d", "prompts": {"source": ["prose", "wiki"]}}}, "data.prompts.source"),
])
def test_bad_values_are_one_line_errors(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config(raw, source="x.yaml")
    text = str(info.value)
    assert text.startswith("x.yaml: ") and message in text and "\n" not in text


def test_both_weights_zero_is_an_error():
    raw = with_change("train", "w_rej", 0)
    raw["train"]["w_acc"] = 0
    with pytest.raises(ConfigError, match="cannot both be 0"):
        parse_config(raw)


@pytest.mark.parametrize("text, message", [
    ("data: [unclosed", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_unreadable_files(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_train_section_is_required_for_training():
    with pytest.raises(ConfigError, match="no `train` section"):
        parse_config({"data": {"dir": "d"}}).require_train()


def test_a_config_that_is_not_text_is_refused_in_one_line(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\x86\x00\xff")
    with pytest.raises(ConfigError, match="not valid YAML") as caught:
        load_config(path)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("section, key", [("data", "dir"), ("train", "storage"), ("train", "output")])
def test_a_folder_that_is_a_file_is_refused_before_the_job_starts(tmp_path, section, key):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=f"{section}.{key}: .*a-file is a file, not a folder"):
        parse_config(with_change(section, key, str(tmp_path / "a-file")))
    assert parse_config(with_change(section, key, str(tmp_path / "new"))) is not None


@pytest.mark.parametrize("section, key, value, reason", [
    ("data", "dir", "~no-such-user-xyz/d", "not a usable path"),
    ("data", "dir", "/tmp/" + "a" * 300, "not a usable path"),
    ("train", "storage", "/tmp/x\0y", "not a usable path"),
    ("train", "name", "..", "dots alone"),
    ("train", "seed", 2 ** 70, "less than or equal to"),
    ("train", "mixing_seed", 2 ** 64, "less than or equal to"),
    ("scaling", "cpus_per_worker", 0.00001, "greater than or equal to 0.0001"),
    ("scaling", "threads", 2 ** 31, "less than or equal to 4096"),
    ("models", "draft_vocab", "bogus", "expected 'full', 'ascii' or a JSON file"),
    ("sweep", "depths", [1, 1], "distinct depths"),
    ("sweep", "w_rej", [1, 1.0000001], "distinct in their first 6 digits"),
])
def test_values_a_job_would_fail_on_minutes_in_are_refused_where_the_config_loads(section, key, value, reason):
    with pytest.raises(ConfigError, match=f"{section}.{key}: .*{reason}"):
        parse_config(with_change(section, key, value))


def test_empty_prompt_sources_and_feature_layers_are_refused():
    with pytest.raises(ConfigError, match="data.prompts.source"):
        parse_config({**MINIMAL, "data": {"dir": "d", "prompts": {"source": []}}})
    with pytest.raises(ConfigError, match="data.features.layers"):
        parse_config({**MINIMAL, "data": {"dir": "d", "kind": "features", "features": {"layers": []}}})


@pytest.mark.parametrize("section, key", [("data", "dir"), ("train", "storage"), ("train", "output")])
def test_a_uri_is_refused_not_made_a_local_folder(section, key):
    # (s3://b/runs was written to ./s3:/b/runs: on a cluster, checkpoints per node or lost with the job)
    with pytest.raises(ConfigError, match=f"{section}.{key}: .*'s3://bucket/x' is a URI"):
        parse_config(with_change(section, key, "s3://bucket/x"))


@pytest.mark.parametrize("key", ["storage", "output"])
def test_a_folder_the_job_cannot_write_is_refused_before_it_starts(tmp_path, monkeypatch, key):
    import specdec.training.config as config_module

    locked = tmp_path / "read-only"
    locked.mkdir()
    # (root passes permission bits, so the read-only file system is played by os.access)
    real_access = config_module.os.access
    monkeypatch.setattr(config_module.os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    with pytest.raises(ConfigError, match=f"train.{key}: .*read-only is not writable"):
        parse_config(with_change("train", key, str(locked / "runs")))
    assert parse_config(with_change("data", "dir", str(locked / "data"))) is not None  # data are only read there


def test_a_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="train.output: .*a-file is a file, not a folder"):
        parse_config(with_change("train", "output", str(tmp_path / "a-file" / "head")))


def test_the_feature_draft_config_continues_the_shipped_draft():
    """`init: default-feature` names the draft shipped in the package (a folder of a run nobody
    kept would refuse the command the README gives)."""
    from specdec.drafts import SHIPPED_FEATURE_DRAFTS
    from specdec.models.feature_files import read_config

    draft = load_config(SHIPPED[0].parent / "feature-draft.yaml").require_draft()
    assert Path(draft.init) == SHIPPED_FEATURE_DRAFTS["default-feature"]
    assert read_config(draft.init).inputs == draft.inputs
    assert Path(parse_config({**MINIMAL, "data": {"dir": "d", "kind": "features"},
                              "draft": {"storage": "s", "output": "o", "init": "~/x"}}).require_draft().init) == \
        Path("~/x").expanduser()
