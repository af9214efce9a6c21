"""Head training: features, the epoch on a learnable synthetic task, the real TorchTrainer with
checkpoint and resume, sweep selection, bad input before training."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import record_checkpoint

from specdec.builder import EngineConfig, build_draft
from specdec.cli import RESUME_TRAINING
from specdec.errors import IncompatibleModelsError, SpecDecError
from specdec.features import (
    FEATURES_DISTRIBUTION, FEATURES_HIDDEN, NUM_SCALAR_FEATURES, SCALAR_FEATURES, distribution_features,
)
from specdec.head import AcceptanceHead, HeadConfig, load_head
from specdec.policies import FixedK
from specdec.policies.specdec_pp import judged_acceptance
from specdec.rounds import DraftRow, propose
from specdec.sampling import SamplingParams
from specdec.training.checkpoints import latest_history
from specdec.training.config import ConfigError, TrainSection, parse_config
from specdec.training.mixing import mix_tokens
from specdec.training.mixing import mixing_generator
from specdec.training.train import (
    FEATURE_FORMAT,
    REPORT_FILE,
    check_dataset,
    check_run,
    head_inputs,
    load_features,
    new_head,
    select_run,
    sweep_heads,
    mixed_sequence_features,
    response_features,
    train_epoch,
    train_head,
    validate,
)

TRAIN = dict(storage="s", output="o")


def synthetic_split(n: int, hidden: int, seed: int) -> dict:
    """Acceptance decided by a direction in feature space: P = sigmoid(8 * <w, e>)."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(n, hidden, generator=generator)
    direction = torch.ones(hidden) / math.sqrt(hidden)
    labels = torch.sigmoid(8.0 * features @ direction)
    return {"hidden": features.half(), "labels": labels, "positions": torch.arange(n) % 25}


def test_head_learns_a_predictable_acceptance():
    train_set, val_set = synthetic_split(2048, 16, seed=0), synthetic_split(512, 16, seed=1)
    config = TrainSection(**TRAIN, depth=1, w_rej=1.0, batch_size=64, lr=1e-2)
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=16, depth=1, draft_identity="x"))
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr)
    before, _ = validate(head, val_set, config, "cpu")
    losses = [train_epoch(head, optimizer, train_set, torch.randperm(2048), config) for _ in range(5)]
    after, full = validate(head, val_set, config, "cpu")
    assert losses[-1] < losses[0]
    assert after["val_auroc"] > 0.95 > before["val_auroc"]  # the ceiling with these soft labels is about 0.98
    assert after["val_kl"] < 0.02 and after["val_ece"] < 0.05
    assert [row["position"] for row in full["per_position"]][-1] == "20+"
    assert len(full["reliability"]["count"]) == 10


def test_features_are_the_draft_states_at_draft_positions(tiny_pair):
    draft, _ = build_draft(EngineConfig(draft=str(tiny_pair[0]), draft_format="fp32"), progress=False)
    row = {"prompt_id": "p", "prompt_ids": [257, 40, 41], "response_ids": [50, 51, 52, 53, 54, 55],
           "draft_ids": [[1, 2, 3, 4, 5, 6], [60, 61, 62, 63, 64, 65]],
           "labels": [[0.0] * 6, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]}
    features = mixed_sequence_features(draft.model, row, 1, ratio=0.5, seed=3, sampling=SamplingParams(temperature=1.0))
    hidden, labels, positions = features["hidden"], features["labels"], features["positions"]
    z, is_draft = mix_tokens(torch.tensor(row["response_ids"]), torch.tensor(row["draft_ids"][1]), 0.5,
                             mixing_generator(3, "p", 1))
    assert positions.tolist() == torch.nonzero(is_draft).flatten().tolist() and 0 < len(positions) < 6
    assert labels.tolist() == pytest.approx([row["labels"][1][i] for i in positions.tolist()])
    assert features["temperatures"].tolist() == [1.0] * len(positions)
    for k, i in enumerate(positions.tolist()):  # e(prompt, Z_<i, Y_i), recomputed alone
        ids = torch.tensor([row["prompt_ids"] + z[:i].tolist() + [row["draft_ids"][1][i]]])
        with torch.no_grad():
            expected = draft.model.model(input_ids=ids).last_hidden_state[0, -1]
        torch.testing.assert_close(hidden[k].float(), expected, atol=2e-3, rtol=2e-3)


def test_train_resume_and_saved_head(tiny_dataset, tiny_pair, tmp_path):
    """Two steps through the real TorchTrainer: one epoch, then the same run with epochs = 2
    resumes from its checkpoint and trains only the second epoch."""
    raw, _ = tiny_dataset
    raw = {**raw, "scaling": {"num_workers": 1, "threads": 1},
           "train": {**raw["train"], "storage": str(tmp_path / "runs"), "output": str(tmp_path / "head")}}
    first = train_head(parse_config(raw))
    assert [e["epoch"] for e in first["epochs"]] == [1] and first["epochs"][0]["resumed_from_epoch"] == 0
    features = list((tmp_path / "runs" / "features").glob("*.pt"))
    assert len(features) == 1
    # a newer checkpoint Ray Train never recorded: a worker's copy cut short by a kill, or whole but
    # killed before the controller's poll (every 2 s). It counted as a trained epoch: the run's
    # rerun with epochs 1 was refused ("has trained 2 epochs"); Ray Train resumes from the one before.
    recorded, = (tmp_path / "runs" / "head").glob("checkpoint_*/")
    orphan = recorded.with_name("checkpoint_9999-12-31_23-59-59.999999")  # after any name Ray Train gives
    orphan.mkdir()
    (orphan / "history.json").write_text(json.dumps(first["epochs"] + [{**first["epochs"][0], "epoch": 2}]))
    (orphan / "state.pt").write_bytes((recorded / "state.pt").read_bytes()[:100])
    assert latest_history(str(tmp_path / "runs"), "head") == first["epochs"]
    manifest, identity, _ = check_dataset(parse_config(raw))
    check_run(parse_config(raw).train, identity, manifest)

    raw["train"]["epochs"] = 2
    second = train_head(parse_config(raw))
    assert [e["epoch"] for e in second["epochs"]] == [1, 2]
    assert second["epochs"][0] == first["epochs"][0]  # epoch 1 came from the checkpoint, not retrained
    assert second["epochs"][1]["resumed_from_epoch"] == 1
    assert list((tmp_path / "runs" / "features").glob("*.pt")) == features  # reused

    draft, _ = build_draft(EngineConfig(draft=str(tiny_pair[0])), progress=False)
    head = load_head(tmp_path / "head", draft_identity=draft.identity, hidden_size=draft.hidden_size)
    assert head.config.depth == 1
    report = json.loads((tmp_path / "head" / REPORT_FILE).read_text())
    final = report["final"]
    assert {"val_loss", "kl", "auroc", "ece", "reliability", "per_position"} <= set(final)
    assert report["data"]["counts"]["train_tokens"] == 5 * 12 * 3
    assert set(report["feature_auroc"]) == {"head", "q_token", "top1_probability", "margin", "entropy"}
    by_temperature = report["by_temperature"]  # the greedy and the sampled label sets, each on its own
    assert set(by_temperature) == {"0", "1"}
    assert by_temperature["0"]["tokens"] * 2 == pytest.approx(by_temperature["1"]["tokens"], rel=0.5)
    assert {"auroc", "feature_auroc", "ece_raw", "ece_calibrated"} <= set(by_temperature["1"])
    calibration = report["calibration"]  # train.calibrate is on by default: fitted and saved with the head
    assert (head.config.calibration.scale, head.config.calibration.bias) == (calibration["scale"], calibration["bias"])
    assert {"ece_before", "ece_after", "reliability_before", "reliability_after"} <= set(calibration)


def test_sigterm_stops_train_head_as_ctrl_c_does_and_a_rerun_resumes(tiny_dataset, ray_local, tmp_path):
    """`kill`, `ray job stop`: SIGTERM ended `specdec train-head` in Ray's crash dump (rc 134), and
    Ctrl-C in rc 1 and no word. Both abort the run as Ray Train does on Ctrl-C: rc 130 and one line
    saying how to resume, which the rerun then does (in this process: its Ray is up already)."""
    raw, _ = tiny_dataset
    runs = tmp_path / "runs"
    raw = {**raw, "scaling": {"num_workers": 1, "threads": 1},  # epochs: more than it could ever train here
           "train": {**raw["train"], "storage": str(runs), "output": str(tmp_path / "head"), "epochs": 10_000}}
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps(raw))  # (JSON is YAML)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    address = ray_local.get_runtime_context().gcs_address  # joins this process's Ray: none to start (~10 s)
    job = subprocess.Popen([sys.executable, "-m", "specdec.cli", "train-head", "--config", str(config),
                            "--address", address],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        # a checkpoint Ray Train recorded (its controller polls the workers every 2 s): the one a rerun resumes
        while not (runs / "head" / "checkpoint_manager_snapshot.json").is_file():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.1)
        # the same run trained again meanwhile (its checkpoints would land among the job's): refused
        with pytest.raises(ConfigError, match=rf"run 'head' in .* is being trained by process {job.pid} on .*; wait"):
            train_head(parse_config(raw))
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, err[-3000:]
    # its own lines, not those Ray forwards from its processes ("(RayTrainWorker pid=N) ...")
    own = [line for line in err.splitlines() if line.strip() and not re.match(r"(\x1b\[\d+m)?\(", line)]
    assert own[-1] == RESUME_TRAINING and err.count(RESUME_TRAINING) == 1, err[-3000:]
    assert not any("Traceback" in line or "SIGTERM received" in line for line in own), err[-5000:]

    done = len(latest_history(str(runs), "head"))
    raw["train"]["epochs"] = done + 1  # (a resumable change) one more epoch, on the interrupted run's checkpoint
    report = train_head(parse_config(raw))
    assert [e["epoch"] for e in report["epochs"]] == list(range(1, done + 2))
    assert report["epochs"][-1]["resumed_from_epoch"] >= 1


def test_a_run_held_by_one_training_is_refused_to_another_until_it_ends(tmp_path):
    from specdec.training.checkpoints import runs_held

    with runs_held(str(tmp_path), ["a", "b"], "draft"):
        with pytest.raises(ConfigError, match=r"run 'b' in .* is being trained by process \d+ on .*; wait for it "
                                              r"to end, or choose another draft.name"):
            with runs_held(str(tmp_path), ["c", "b"], "draft"):
                pass
    with runs_held(str(tmp_path), ["b", "c"], "draft"):  # let go when the block ends, a refused one's too
        pass


def test_a_sweep_holds_train_name_beside_its_runs(tiny_dataset, tmp_path):
    """A sweep saves its choice to train.output, as a plain run of train.name does: it holds that
    name too, so one of them running refuses the other (before any features or training)."""
    from specdec.training.checkpoints import runs_held

    raw, _ = tiny_dataset
    runs = tmp_path / "runs"
    raw = {**raw, "train": {**raw["train"], "storage": str(runs)}, "sweep": {"depths": [1], "w_rej": [1.0]}}
    with runs_held(str(runs), ["head"], "train"):  # a `train-head` of the name running
        with pytest.raises(ConfigError, match=r"run 'head' in .* is being trained by process \d+ on .*; wait"):
            sweep_heads(parse_config(raw))
    assert not any(runs.glob("head-D*"))


def test_a_held_run_is_refused_before_the_dataset_is_hashed(tiny_dataset, tmp_path, monkeypatch):
    """Checking the shards' sha256 reads every byte of the data (tens of seconds on a large
    dataset): a run that another process trains, which cannot go on whatever the data hold, is
    refused first, before the data, the draft or Ray."""
    import specdec.training.data as data
    from specdec.training.checkpoints import runs_held

    hashed, hash_file = [], data.sha256_file
    monkeypatch.setattr(data, "sha256_file", lambda path: hashed.append(path) or hash_file(path))
    raw, _ = tiny_dataset
    runs = tmp_path / "runs"
    raw = {**raw, "train": {**raw["train"], "storage": str(runs)}}
    connected = []
    with runs_held(str(runs), ["head"], "train"):
        with pytest.raises(ConfigError, match=r"run 'head' in .* is being trained by process \d+ on .*; wait"):
            train_head(parse_config(raw), connect=lambda: connected.append(1))
        with pytest.raises(ConfigError, match=r"run 'head' in .* is being trained"):
            sweep_heads(parse_config({**raw, "sweep": {"depths": [1], "w_rej": [1.0]}}),
                        connect=lambda: connected.append(1))
    assert hashed == [] and connected == []


def test_training_refuses_a_foreign_dataset(tiny_dataset, tmp_path):
    """Data made with another draft fail at the identity check, before any features or training."""
    from tiny import byte_tokenizer, tiny_model

    other = tmp_path / "other-draft"
    tokenizer = byte_tokenizer()
    tiny_model(len(tokenizer), 16, 1, seed=7).save_pretrained(other)
    tokenizer.save_pretrained(other)
    raw, _ = tiny_dataset
    raw = {**raw, "models": {**raw["models"], "draft": str(other)},
           "train": {**raw["train"], "storage": str(tmp_path / "runs")}}
    with pytest.raises(IncompatibleModelsError, match="made with another draft model"):
        train_head(parse_config(raw))
    # the run's lock alone (taken before the checks): no features, settings or checkpoints
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["head.lock"]


def test_changed_settings_under_the_same_run_name(tmp_path):
    train, data = TrainSection(storage=str(tmp_path), output="o", depth=2), {"shards": [{"sha256": "a"}]}
    check_run(train, "draft", data)
    check_run(train.model_copy(update={"depth": 1}), "draft", data)  # no checkpoint yet (it failed first): a new run
    # a folder a worker copied a checkpoint into before the run was killed, which Ray Train never
    # recorded (its controller polls every 2 s): nothing to resume, so it binds nothing either
    unrecorded = tmp_path / "head" / "checkpoint_2026-12-01_10-00-00.000000"
    unrecorded.mkdir(parents=True)
    (unrecorded / "history.json").write_text(json.dumps([{"epoch": 1}]))
    check_run(train, "draft", data)  # (depth 2 again, not the depth 1 that run started with)
    record_checkpoint(tmp_path / "head", "checkpoint_2026-12-01_10-00-01.000000", [{"epoch": 1}, {"epoch": 2}])
    resumed = train.model_copy(update={"epochs": 20, "calibrate": False})
    check_run(resumed, "draft", data)  # more epochs, another calibration: a resume
    with pytest.raises(ConfigError, match="run 'head' .* started with other settings \\(depth\\)"):
        check_run(train.model_copy(update={"depth": 3}), "draft", data)
    # other data or another draft under the name resumed silently (a head trained on both, reported on one)
    with pytest.raises(ConfigError, match="started with other settings \\(data\\)"):
        check_run(resumed, "draft", {"shards": [{"sha256": "a"}, {"sha256": "b"}]})
    with pytest.raises(ConfigError, match="started with other settings \\(data\\)"):
        check_run(resumed, "another draft", data)
    # fewer epochs than the checkpoint has saved the longer-trained head, reported as the shorter
    with pytest.raises(ConfigError, match="has trained 2 epochs, more than train.epochs 1"):
        check_run(resumed.model_copy(update={"epochs": 1}), "draft", data)
    # newer folders Ray Train never recorded, cut short or whole: what it resumes from counts alone
    cut = tmp_path / "head" / "checkpoint_2026-12-01_10-00-02.000000"
    cut.mkdir()
    (cut / "history.json").write_text('[{"epoch": 1}, {"ep')
    whole = tmp_path / "head" / "checkpoint_2026-12-01_10-00-03.000000"
    whole.mkdir()
    (whole / "history.json").write_text(json.dumps([{"epoch": 1}, {"epoch": 2}, {"epoch": 3}]))
    check_run(resumed.model_copy(update={"epochs": 2}), "draft", data)
    with pytest.raises(ConfigError, match="has trained 2 epochs"):
        check_run(resumed.model_copy(update={"epochs": 1}), "draft", data)


def test_a_run_ray_train_cannot_resume_is_refused_in_one_line(tmp_path):
    """A snapshot cut short (Ray Train writes it in place) or of another Ray version: fit() would fail
    on it with a traceback; refused before Ray starts."""
    train, data = TrainSection(storage=str(tmp_path), output="o"), {"shards": [{"sha256": "a"}]}
    check_run(train, "draft", data)
    record_checkpoint(tmp_path / "head", "checkpoint_2026-12-01_10-00-00.000000", [{"epoch": 1}])
    snapshot = tmp_path / "head" / "checkpoint_manager_snapshot.json"
    snapshot.write_text(snapshot.read_text()[:40])
    with pytest.raises(ConfigError, match=r"^run 'head' in .*: Ray Train cannot resume it \(.*\); start a new run "
                                          r"under another name$"):
        check_run(train, "draft", data)


def test_a_head_run_recorded_before_its_data_were_resumes(tmp_path):
    train, data = TrainSection(storage=str(tmp_path), output="o"), {"shards": [{"sha256": "a"}]}
    (tmp_path / "head.settings.json").write_text(json.dumps(train.model_dump(exclude={"epochs", "output"})))
    record_checkpoint(tmp_path / "head", "checkpoint_2026-12-01_10-00-00.000000", [{"epoch": 1}])
    check_run(train, "draft", data)
    with pytest.raises(ConfigError, match="other settings \\(depth\\)"):
        check_run(train.model_copy(update={"depth": 0}), "draft", data)


def test_sweep_selection():
    runs = [{"depth": 0, "val_auroc": 0.7, "val_kl": 0.2}, {"depth": 3, "val_auroc": 0.8, "val_kl": 0.3},
            {"depth": 4, "val_auroc": math.nan, "val_kl": math.nan}]
    assert select_run(runs, "auroc")["depth"] == 3
    assert select_run(runs, "kl")["depth"] == 0


def test_rich_features_in_training_equal_what_the_policy_sees(tiny_pair):
    """A round drafted by the real loop (T = 1, so q(y_i) is not always the top-1), replayed as a
    training row whose Z is the round's candidates: the `hidden+distribution` inputs match step by
    step (the hidden state q_i came from, q_i's features at y_i, the position i), and so does the
    head's judgement."""
    draft, _ = build_draft(EngineConfig(draft=str(tiny_pair[0]), draft_format="fp32"), progress=False)
    sampling = SamplingParams(temperature=1.0, top_k=50)
    steps = []

    class Recording(FixedK):
        def decide(self, step):
            steps.append(step)
            return super().decide(step)

    history = [257, 40, 41, 42, 43]
    row = DraftRow(draft.new_session(), history, Recording(6), 6, 0, sampling, torch.Generator().manual_seed(5))
    candidates = propose(draft, [row])[0].candidates
    assert len(candidates) == len(steps) == 6
    training_row = {"prompt_id": "p", "prompt_ids": history, "response_ids": candidates, "draft_ids": [candidates],
                    "labels": [[0.5] * 6]}
    cached, = response_features(draft.model, training_row, ratio=0.0, seed=0, samplings=[sampling])  # r = 0: positions 1..6
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=draft.hidden_size, depth=1, draft_identity="x",
                                     features=FEATURES_DISTRIBUTION)).eval()
    head.fit_input_statistics(cached["hidden"], cached["scalars"])
    for i, step in enumerate(steps):
        assert step.index == i + 1 and step.token == candidates[i]
        torch.testing.assert_close(cached["scalars"][i], distribution_features(
            step.probs, torch.tensor(step.token), torch.tensor(step.index)), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cached["hidden"][i].float(), step.hidden, atol=2e-3, rtol=2e-3)  # fp16 cache
        with torch.no_grad():
            training_view = float(torch.sigmoid(head(head_inputs(FEATURES_DISTRIBUTION, cached, slice(i, i + 1)))))
        assert judged_acceptance(head, step) == pytest.approx(training_view, abs=1e-3)
    assert cached["scalars"][:, SCALAR_FEATURES.index("log_position")].exp().round().tolist() == [1, 2, 3, 4, 5, 6]
    assert cached["scalars"][:, SCALAR_FEATURES.index("greedy")].tolist() == [0.0] * 6


def test_two_runs_computing_one_feature_cache_leave_each_other_alone(tiny_dataset, tmp_path):
    """Runs of other names are not held by each other, and on the same data and feature settings they
    share a feature cache: both computed it through `<key>.pt.partial`, where the first to finish
    renamed the other's half-written file in place of its own (a cache cut short, read next) and the
    second's rename then failed (FileNotFoundError, after the work)."""
    from specdec.training.train import compute_features

    raw, _ = tiny_dataset
    out = tmp_path / "features" / "key.pt"
    out.parent.mkdir()
    theirs = out.with_name(out.name + ".partial")  # the other run's, mid-write
    theirs.write_bytes(b"half of it")
    compute_features(parse_config(raw), raw["data"]["dir"], str(out), "identity")
    assert load_features(out)["draft_identity"] == "identity"
    assert theirs.read_bytes() == b"half of it"
    assert sorted(p.name for p in out.parent.iterdir()) == ["key.pt", theirs.name]  # nothing of this one's left


def test_the_feature_cache_refuses_another_format(tmp_path):
    path = tmp_path / "features.pt"
    torch.save({"hidden_size": 4, "train": {}}, path)  # format 1 wrote no "format"
    with pytest.raises(SpecDecError, match="format 1"):
        load_features(path)
    torch.save({"format": FEATURE_FORMAT}, path)
    assert load_features(path)["format"] == FEATURE_FORMAT


def test_a_rich_head_trains_on_scalar_features():
    """Acceptance decided by a scalar feature only: the rich head learns it, the hidden-only head cannot."""
    generator = torch.Generator().manual_seed(0)

    def split(n):
        scalars = torch.randn(n, NUM_SCALAR_FEATURES, generator=generator)
        return {"hidden": torch.randn(n, 8, generator=generator).half(), "scalars": scalars,
                "labels": torch.sigmoid(6.0 * scalars[:, 0]), "positions": torch.arange(n) % 25}

    features = {"hidden_size": 8, "draft_identity": "x", "train": split(2048), "validation": split(512)}
    aurocs = {}
    for kind in (FEATURES_HIDDEN, FEATURES_DISTRIBUTION):
        config = TrainSection(**TRAIN, depth=1, w_rej=1.0, batch_size=64, lr=1e-2, features=kind)
        torch.manual_seed(0)
        head = new_head(config, features)
        optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr)
        for _ in range(3):
            train_epoch(head, optimizer, features["train"], torch.randperm(2048), config)
        aurocs[kind] = validate(head, features["validation"], config, "cpu")[0]["val_auroc"]
    assert aurocs[FEATURES_DISTRIBUTION] > 0.9 and aurocs[FEATURES_HIDDEN] < 0.65
