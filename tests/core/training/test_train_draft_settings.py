"""train-head on data labelled with another `models.draft_format` or `models.draft_vocab` (bug hunt:
taken silently; the features' draft pass read the config's, the labels were the data's, and the
feature cache's key holds neither, so a cache of the other setting was reused as well)."""

from __future__ import annotations

import json

import pytest

from specdec.training.config import parse_config
from specdec.training.data import DatasetError
from specdec.training.train import check_dataset, train_head


@pytest.mark.parametrize("key, value", [("draft_vocab", "ascii"), ("draft_format", "onednn"), ("draft_vocab", "FILE")])
def test_other_draft_settings_than_the_datas_are_refused_before_ray(tiny_dataset, tmp_path, key, value):
    raw, _ = tiny_dataset
    if value == "FILE":
        value = str(tmp_path / "vocab.json")
        (tmp_path / "vocab.json").write_text(json.dumps(list(range(200))))
    changed = {**raw, "models": {**raw["models"], key: value},
               "train": {**raw["train"], "storage": str(tmp_path / "runs"), "name": "other"}}
    with pytest.raises(DatasetError, match=f"was labelled with models.{key} .*, not '{value}'"):
        train_head(parse_config(changed), connect=lambda: pytest.fail("Ray started for data of another setting"))


def test_the_datas_own_draft_settings_pass(tiny_dataset):
    raw, _ = tiny_dataset
    manifest, _, _ = check_dataset(parse_config({**raw, "models": {**raw["models"], "draft_vocab": "full"}}))
    assert manifest["settings"]["draft_vocab"] == "full" and manifest["settings"]["draft_format"] == "fp32"
