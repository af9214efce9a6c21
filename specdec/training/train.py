"""Training the acceptance head as a Ray Train job (paper §3.3; `specdec train-head`).

Steps, each its own function, all under the run's lock (checkpoints.runs_held: a run another
process trains is refused before step 1 reads the data):

1. `check_dataset`: the manifest's draft identity must be the draft being trained, every shard
   non-empty and intact (sha256) -- all before any Ray work.
2. `cache_features` (a Ray task, on a GPU when the scaling section asks for one): the head's
   inputs for every response and label set (`row_features`), with the draft-distribution features
   of Y_i (specdec/features.py; always kept, for the single-feature AUROCs), P_i and the response
   position. The paper's `hidden` head reads the state after the draft has read Y_i, so each label
   set gets one mixing draw Z (r of the tokens from the target's X, the rest from Y, seeded per
   prompt and set) and one frozen-draft pass over prompt + Z (`mixed_sequence_features`); a
   `hidden+distribution` head reads what q_i came from, so one pass over prompt + X serves every
   position and every label set (`response_features`). Saved once as a tensor file in the run's
   storage directory, keyed by the data's shards, the draft, the mixing settings, the feature kind
   and `FEATURE_FORMAT`.
3. `TorchTrainer` with `train_loop`: weighted BCE (loss.py) on the cached features, data parallel
   over the scaling section's workers; after every epoch the validation metrics (evaluation.py:
   loss, binary KL, AUROC, ECE with reliability data, per position) are reported with a checkpoint
   through `ray.train.report`. Re-running with the same `train.storage` and `train.name` resumes
   from the latest checkpoint (Ray Train restores the run; `ray.train.get_checkpoint` hands it to
   the loop), so raising `epochs` continues a finished run.
4. The last checkpoint's head is calibrated on the validation tokens (calibration.py, unless
   `train.calibrate` is off) and saved in specdec.head's format (with the draft's identity) plus
   `training.json` (settings, data counts, per-epoch history, final metrics, the single features'
   AUROCs, the calibration with ECE before and after).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.errors import SpecDecError
from specdec.features import (
    FEATURES_DISTRIBUTION, FEATURES_HIDDEN, NUM_SCALAR_FEATURES, distribution_features, join_head_inputs,
    round_positions,
)
from specdec.files import written_together
from specdec.head import AcceptanceHead, HeadConfig
from specdec.models.vocab import SETTINGS_BEFORE_DRAFT_VOCAB, vocab_setting
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.training import checkpoints
from specdec.training.calibration import calibration_report, cross_fitted_predictions
from specdec.training.config import SELECT_BY, ConfigError, PipelineConfig, TrainSection
from specdec.training.data import SPLITS, DatasetError, head_sequences, load_dataset, read_manifest
from specdec.training.evaluation import calibration, evaluate_head, feature_aurocs, soft_label_auroc
from specdec.training.loss import weighted_bce_loss
from specdec.training.feature_labels import (LABEL_STEPS, cache_settings, check_feature_head_data,
                                             feature_draft_features)
from specdec.training.mixing import mix_tokens, mixing_generator

FEATURES_SUBDIR = "features"
METRICS_FILE = "metrics.json"
REPORT_FILE = "training.json"
FEATURE_DTYPE = torch.float16  # halves the cache; the head trains in fp32
# Version of the feature cache's layout and meaning: part of its key, and checked when it is read,
# so a cache written by another version is recomputed, never misread.
# 1: hidden, labels, positions (the paper's e_i only). 2: + scalars, the kind of hidden state, format.
# 3: one mixed sequence per label set, + temperatures, the scalar `greedy`; `hidden+distribution`
#    read over prompt + X at every position (response_features).
FEATURE_FORMAT = 3
CHECKPOINTS_TO_KEEP = 2
# Settings that may change when a run resumes (all others would make the checkpoint meaningless).
RESUMABLE_CHANGES = ("epochs", "output", "calibrate")  # calibration is applied at saving


# -- features ------------------------------------------------------------------------------------

@torch.inference_mode()
def mixed_sequence_features(draft_model, row: dict, label_set: int, ratio: float, seed: int,
                            sampling: SamplingParams = SamplingParams()) -> dict[str, torch.Tensor]:
    """The paper's head (`hidden`): its features at the M draft positions of one mixed sequence, made
    of the response X and label set `label_set` of the row (its Y and P, drawn through `sampling`):
    {"hidden" [M, H] fp16, "scalars" [M, S] fp32, "labels" [M], "positions" [M] (response positions),
    "temperatures" [M]}.

    The draft reads prompt + Z once. At response position i its final hidden state at Z_i is
    e(prompt, Z_<i, Z_i), which is e(prompt, Z_<i, Y_i) exactly where Z_i was taken from Y
    (mixing.py): the paper's input, which exists only after the draft has read Y_i, hence the mixing.
    The scalars (kept for the single-feature AUROCs) are q_i's at Y_i, q_i from the state at the
    token before Z_i, through `sampling` as the drafting loop transforms it.

    Worked example: prompt [a b], Z [z0 z1 z2]: the pass reads [a b z0 z1 z2]; position 1's state
    is the output at z1, its q_1 the output at z0."""
    x = torch.tensor(row["response_ids"], dtype=torch.long)  # [N]
    y = torch.tensor(row["draft_ids"][label_set], dtype=torch.long)  # [N]
    z, is_draft = mix_tokens(x, y, ratio, mixing_generator(seed, row["prompt_id"], label_set))  # [N], [N]
    n, prompt_len = len(x), len(row["prompt_ids"])
    device = next(draft_model.parameters()).device
    ids = torch.tensor([list(row["prompt_ids"]) + z.tolist()], dtype=torch.long, device=device)
    states = draft_model.model(input_ids=ids).last_hidden_state[0]  # [P + N, H]
    after = states[prompt_len:prompt_len + n]  # [N, H] the state at Z_i
    before = states[prompt_len - 1:prompt_len - 1 + n]  # [N, H] the state q_i comes from
    # q_i at the draft positions only: [M, V] (the LM head over every position would cost N x V)
    q = probs_from_logits(draft_model.lm_head(before[is_draft.to(device)]).float(), sampling).cpu()
    scalars = distribution_features(q, y[is_draft], round_positions(is_draft)[is_draft], sampling.greedy)
    labels = torch.tensor(row["labels"][label_set], dtype=torch.float32)
    m = int(is_draft.sum())
    return {"hidden": after.cpu()[is_draft].to(FEATURE_DTYPE), "scalars": scalars,
            "labels": labels[is_draft], "positions": torch.arange(n)[is_draft],
            "temperatures": torch.full((m,), sampling.temperature)}


@torch.inference_mode()
def response_features(draft_model, row: dict, ratio: float, seed: int,
                      samplings: list[SamplingParams]) -> list[dict[str, torch.Tensor]]:
    """A `hidden+distribution` head's features at every response position, one dict per label set
    (keys as `mixed_sequence_features`, M = N).

    This head judges y_i from the state q_i comes from and q_i at y_i: exactly the context the label
    P_i was made in, prompt + X_<i (data.py), and at drafting a candidate's judgement only matters
    when y_<i were accepted, i.e. when they are what the target would have written. So the draft
    reads prompt + X once and that pass serves every position and every label set: no mixing (it
    exists for the paper's head, which reads the state after y_i), and no mismatch between the q
    the label used and the q the features read (under mixing, the features' q_i is conditioned on
    Z_<i, mostly draft tokens). The position of y_i in its round, which a pass over X does not
    have, follows the runs of the mixing draw (1, 2, 3, ... over its draft runs, 1 elsewhere), so
    its distribution resembles drafting's.

    Worked example: prompt [a b], X [x0 x1 x2]: the pass reads [a b x0 x1]; position 0's state is
    the output at b, position 2's the output at x1."""
    x = torch.tensor(row["response_ids"], dtype=torch.long)  # [N]
    prompt_len = len(row["prompt_ids"])
    device = next(draft_model.parameters()).device
    ids = torch.tensor([list(row["prompt_ids"]) + x[:-1].tolist()], dtype=torch.long, device=device)
    before = draft_model.model(input_ids=ids).last_hidden_state[0, prompt_len - 1:]  # [N, H]
    logits = draft_model.lm_head(before).float().cpu()  # [N, V]
    return pass_features(before.cpu(), logits, row, ratio, seed, samplings, row["draft_ids"], row["labels"])


def pass_features(hidden: torch.Tensor, logits: torch.Tensor, row: dict, ratio: float, seed: int,
                  samplings: list[SamplingParams], draft_ids: list[list[int]],
                  labels: list[list[float]]) -> list[dict[str, torch.Tensor]]:
    """`response_features` from the draft's pass over prompt + X: its hidden states [N, H] and
    logits [N, V] at the response positions, one label set per sampling (Y `draft_ids` [L][N],
    P `labels` [L][N])."""
    x = torch.tensor(row["response_ids"], dtype=torch.long)  # [N]
    n, hidden = len(x), hidden.to(FEATURE_DTYPE)
    out = []
    for label_set, sampling in enumerate(samplings):
        y = torch.tensor(draft_ids[label_set], dtype=torch.long)  # [N]
        _, is_draft = mix_tokens(x, y, ratio, mixing_generator(seed, row["prompt_id"], label_set))
        positions = round_positions(is_draft).clamp_min(1)  # [N]
        scalars = distribution_features(probs_from_logits(logits, sampling), y, positions, sampling.greedy)
        out.append({"hidden": hidden, "scalars": scalars,
                    "labels": torch.tensor(labels[label_set], dtype=torch.float32),
                    "positions": torch.arange(n), "temperatures": torch.full((n,), sampling.temperature)})
    return out


def row_features(draft_model, row: dict, train: TrainSection, samplings: list[SamplingParams]) -> list[dict]:
    """The features of every label set of a row, for the head kind `train.features`."""
    if train.features == FEATURES_DISTRIBUTION:
        return response_features(draft_model, row, train.mixing_ratio, train.mixing_seed, samplings)
    if train.features != FEATURES_HIDDEN:
        raise ValueError(f"unknown head features {train.features!r}")
    return [mixed_sequence_features(draft_model, row, i, train.mixing_ratio, train.mixing_seed, sampling)
            for i, sampling in enumerate(samplings)]


def feature_key(manifest: dict, train: TrainSection, draft_identity: str, labels: dict | None = None) -> str:
    """The feature cache's key: the data's shards, the draft, what the features read; a feature
    draft's (`labels`: its label sets and steps, made with the features)."""
    shards = [s["sha256"] for s in manifest["shards"]]
    blob = json.dumps([draft_identity, shards, train.mixing_ratio, train.mixing_seed, train.features, FEATURE_FORMAT]
                      + ([labels] if labels else []) + ([train.max_sequences] if train.max_sequences else []))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def label_sampling(manifest: dict, temperature: float) -> SamplingParams:
    """The sampling transform a label set was made with: the features see q through it."""
    labels = manifest["settings"]["labels"]
    return SamplingParams(temperature=temperature, top_p=labels["top_p"], top_k=labels["top_k"])


def load_features(path: str | Path) -> dict:
    """A feature cache, refused when another `FEATURE_FORMAT` wrote it."""
    features = torch.load(path, weights_only=True)
    if features.get("format") != FEATURE_FORMAT:
        raise SpecDecError(f"feature cache {path} has format {features.get('format', 1)}, this version reads "
                           f"{FEATURE_FORMAT}: delete it to recompute")
    return features


def model_draft_features(config: PipelineConfig, data_dir: str, splits: tuple[str, ...] = SPLITS
                         ) -> tuple[dict[str, list[dict]], int]:
    """(per split, the parts of every labelled response's features; the draft's hidden size)."""
    from tqdm.auto import tqdm

    from specdec.builder import build_draft

    train, scaling = config.require_train(), config.scaling
    manifest, rows = load_dataset(data_dir)
    draft, _ = build_draft(config.models.engine_config(scaling.threads), progress=False)
    model = draft.model
    if scaling.use_gpu and torch.cuda.is_available():
        model = model.to("cuda")
    parts = {}
    for split in splits:
        responses = head_sequences([row for row in rows if row["split"] == split and row["response_ids"]], split, train)
        parts[split] = [part for row in tqdm(responses, desc=f"features ({split})", unit="response")
                        for part in row_features(model, row, train, [label_sampling(manifest, t)
                                                                     for t in row["label_temperatures"]])]
    return parts, draft.hidden_size


def compute_features(config: PipelineConfig, data_dir: str, out_path: str, draft_identity: str,
                     splits: tuple[str, ...] = SPLITS) -> str:
    """Run the frozen draft over every sequence of `splits` once and save the features (see module
    docstring; a feature draft's come from its features dataset: feature_labels.py)."""
    train = config.require_train()
    if config.scaling.threads:
        torch.set_num_threads(config.scaling.threads)
    features: dict = {"format": FEATURE_FORMAT, "features": train.features}
    if config.data.kind == "features":
        parts, hidden_size = feature_draft_features(config, data_dir, splits)
        features["label_steps"] = LABEL_STEPS  # one row per response position and draft step
    else:
        parts, hidden_size = model_draft_features(config, data_dir, splits)
    empty = {"hidden": torch.empty(0, hidden_size, dtype=FEATURE_DTYPE),
             "scalars": torch.empty(0, NUM_SCALAR_FEATURES), "labels": torch.empty(0),
             "positions": torch.empty(0, dtype=torch.long), "temperatures": torch.empty(0)}
    for split in SPLITS:
        found = parts.get(split, [])
        features[split] = {k: torch.cat([p[k] for p in found]).to(v.dtype) if found else v for k, v in empty.items()}
    features["hidden_size"] = hidden_size
    features["draft_identity"] = draft_identity
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    # under a name of this process's own: runs of other names (not held by each other) may compute
    # the same cache at once, and a shared name had one rename the other's half-written file
    with written_together(out_path) as (partial,):
        torch.save(features, partial)
    return out_path


# -- the Ray Train loop --------------------------------------------------------------------------

def head_settings(train: TrainSection) -> dict:
    """The head's shape from the train section (HeadConfig's fields of the same names)."""
    return {"depth": train.depth, "features": train.features, "bottleneck": train.bottleneck,
            "dropout": train.dropout}


def new_head(train: TrainSection, features: dict) -> AcceptanceHead:
    """An untrained head for the cached features, its input standardised on the training split."""
    head = AcceptanceHead(HeadConfig(hidden_size=features["hidden_size"], draft_identity=features["draft_identity"],
                                     **head_settings(train)))
    split = features["train"]
    # every worker sees the same features
    head.fit_input_statistics(split["hidden"], split["scalars"] if train.features == FEATURES_DISTRIBUTION else None)
    return head


def head_inputs(features: str, split: dict, index: torch.Tensor | slice) -> torch.Tensor:
    """The head's inputs [B, I] fp32 for rows `index` of a feature split (features.join_head_inputs; from
    the settings, because the Ray Train model is wrapped)."""
    scalars = split["scalars"][index].float() if features == FEATURES_DISTRIBUTION else None
    return join_head_inputs(features, split["hidden"][index].float(), scalars)


def train_loop(loop_config: dict) -> None:
    """Runs on every Ray Train worker: the head on cached features, one report per epoch."""
    import ray.train
    import ray.train.torch

    train = TrainSection(**loop_config["train"])
    features = load_features(loop_config["features"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(train.seed)
    head = new_head(train, features)
    optimizer = torch.optim.AdamW(head.parameters(), lr=train.lr, weight_decay=train.weight_decay)
    start_epoch, history = checkpoints.resume(head.load_state_dict, optimizer, "head", "epoch")
    model = ray.train.torch.prepare_model(head)
    device = ray.train.torch.get_device()

    train_set, val_set = features["train"], features["validation"]
    per_worker = len(train_set["labels"]) // world  # equal shares: every worker takes the same number of steps
    for epoch in range(start_epoch, train.epochs):
        order = torch.randperm(len(train_set["labels"]), generator=torch.Generator().manual_seed(train.seed + epoch))
        train_loss = train_epoch(model, optimizer, train_set, order[rank * per_worker:(rank + 1) * per_worker],
                                 train, device)
        metrics, full = validate(head, val_set, train, device)
        metrics.update(epoch=epoch + 1, train_loss=train_loss, resumed_from_epoch=start_epoch)
        history.append(metrics)
        checkpoints.report(metrics, {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1},
                           history, rank, files={METRICS_FILE: json.dumps(full, indent=2) + "\n"})


def train_epoch(model, optimizer, train_set: dict, order: torch.Tensor, train: TrainSection, device="cpu") -> float:
    """One pass over train_set's rows in `order` (this worker's share); returns the mean loss."""
    model.train()
    total, count = 0.0, 0
    for start in range(0, len(order), train.batch_size):
        index = order[start:start + train.batch_size]
        inputs = head_inputs(train.features, train_set, index).to(device)  # [B, I]
        labels = train_set["labels"][index].to(device)  # [B]
        loss = weighted_bce_loss(model(inputs), labels, w_acc=train.w_acc, w_rej=train.w_rej,
                                 reduction=train.reduction)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total, count = total + float(loss.detach()) * len(index), count + len(index)
    return total / max(count, 1)


@torch.no_grad()
def validate(head: AcceptanceHead, val_set: dict, train: TrainSection, device) -> tuple[dict, dict]:
    """(scalar metrics for ray.train.report, the full metrics with reliability and per position)."""
    logits = raw_logits(head, val_set, train, device)
    labels = val_set["labels"]
    result = evaluate_head(logits, labels, positions=val_set["positions"])
    loss = float(weighted_bce_loss(logits, labels, w_acc=train.w_acc, w_rej=train.w_rej, reduction=train.reduction))
    scalars = {f"val_{k}": v for k, v in result.scalars().items()}
    scalars["val_loss"] = loss
    return scalars, {"val_loss": loss, **result.to_dict()}


@torch.no_grad()
def raw_logits(head: AcceptanceHead, split: dict, train: TrainSection, device="cpu") -> torch.Tensor:
    """The head's uncalibrated logits [N] over a feature split, in batches."""
    head.eval()
    n = len(split["labels"])
    return torch.cat([head(head_inputs(train.features, split, slice(i, i + train.batch_size)).to(device)).cpu()
                      for i in range(0, n, train.batch_size)] or [torch.empty(0)])


# -- the job -------------------------------------------------------------------------------------

def check_dataset(config: PipelineConfig) -> tuple[dict, str, str]:
    """(manifest, draft identity, draft name) after checking the data belong to this draft; no Ray.
    On a features dataset the draft is the feature draft the config trains (feature_labels.py)."""
    from specdec.models.sources import model_identity, resolve_model

    if config.data.kind == "features":
        manifest = read_manifest(Path(config.data.dir))
        directory, identity = check_feature_head_data(config, manifest)
        return manifest, identity, directory
    draft_dir = resolve_model(config.models.draft, role="draft", cache=config.models.cache_dir)
    identity = model_identity(draft_dir)
    manifest, rows = load_dataset(config.data.dir, draft_identity=identity)
    check_draft_settings(config, manifest)
    counts = {split: sum(len(labels) for r in rows if r["split"] == split for labels in r["labels"]) for split in SPLITS}
    if not counts["train"] or not counts["validation"]:
        raise SpecDecError(f"dataset {config.data.dir} needs labelled tokens in both splits "
                           f"(train {counts['train']}, validation {counts['validation']})")
    return manifest, identity, config.models.draft


def check_draft_settings(config: PipelineConfig, manifest: dict) -> None:
    """The draft runs as the data were labelled with: the features' pass reads `models.draft_format` and
    `models.draft_vocab` from the config (and the feature cache's key holds neither), so other ones
    would pair q and hidden states of another draft with the data's labels (gen-data refuses them in
    the same data.dir)."""
    made = {**SETTINGS_BEFORE_DRAFT_VOCAB, **manifest.get("settings", {})}
    for key, value in (("draft_format", config.models.draft_format),
                       ("draft_vocab", vocab_setting(config.models.draft_vocab))):
        if key in made and made[key] != value:
            raise DatasetError(f"dataset {config.data.dir} was labelled with models.{key} {made[key]!r}, not "
                               f"{getattr(config.models, key)!r}: use the setting the data were made with")


def ensure_features(config: PipelineConfig, manifest: dict, draft_identity: str) -> str:
    import ray

    train = config.require_train()
    labels = None
    if config.data.kind == "features":
        labels = cache_settings(config)
    path = Path(train.storage).resolve() / FEATURES_SUBDIR / f"{feature_key(manifest, train, draft_identity, labels)}.pt"
    if path.is_file():
        return str(path)
    data_dir = str(Path(config.data.dir).resolve())
    if not config.scaling.use_gpu:  # in this process: a CPU task would only add a worker's start-up
        return compute_features(config, data_dir, str(path), draft_identity)
    task = ray.remote(compute_features).options(num_cpus=config.scaling.cpus_per_worker,
                                                num_gpus=1 if config.scaling.use_gpu else 0)
    return ray.get(task.remote(config, data_dir, str(path), draft_identity))


def check_run(train: TrainSection, identity: str, manifest: dict) -> None:
    """Before Ray: a run name resumes only its own run (other settings, another draft or other
    data refused), and never past a lower `train.epochs`."""
    data = {"draft_identity": identity, "shards": [shard["sha256"] for shard in manifest["shards"]]}
    checkpoints.check_run_settings(train.storage, train.name, "train", train, RESUMABLE_CHANGES, data)
    done = len(checkpoints.latest_history(train.storage, train.name))
    if done > train.epochs:
        raise ConfigError(f"run {train.name!r} in {train.storage} has trained {done} epochs, more than train.epochs "
                          f"{train.epochs}; raise it, or choose another train.name to start a new run")


def fit_head(config: PipelineConfig, train: TrainSection, features: str):
    """One TorchTrainer run; returns Ray Train's Result (its checkpoint holds the last epoch)."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    scaling = config.scaling
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"train": train.model_dump(), "features": features},
        scaling_config=ScalingConfig(num_workers=scaling.num_workers, use_gpu=scaling.use_gpu,
                                     resources_per_worker={"CPU": scaling.cpus_per_worker}),
        run_config=RunConfig(name=train.name, storage_path=str(Path(train.storage).resolve()),
                             checkpoint_config=CheckpointConfig(num_to_keep=CHECKPOINTS_TO_KEEP)),
    )
    return checkpoints.fit(trainer)


def save_result(result, train: TrainSection, draft_identity: str, draft_name: str, manifest: dict,
                features: str) -> dict:
    """Save the head of the run's last checkpoint to `train.output` with its report, calibrated on the
    validation features when `train.calibrate`; returns the report."""
    state, history, files = checkpoints.read_final(result, train.name, files=(METRICS_FILE,))
    final = json.loads(files[METRICS_FILE])
    cached = load_features(features)
    head = AcceptanceHead(HeadConfig(hidden_size=cached["hidden_size"], draft_identity=draft_identity,
                                     draft_name=draft_name, **head_settings(train)))
    head.load_state_dict(state["head"])
    val_set = cached["validation"]
    report = {"train": train.model_dump(), "data": {"dir": manifest.get("dir"), "counts": manifest["counts"],
                                                     "prompt_source": manifest.get("prompt_source")},
              "epochs": history, "final": final,
              "feature_auroc": {"head": final.get("auroc"), **feature_aurocs(val_set["scalars"], val_set["labels"])}}
    logits = raw_logits(head, val_set, train)
    if train.calibrate:
        platt, report["calibration"] = calibration_report(logits, val_set["labels"])
        head.config.calibration = platt
    report["by_temperature"] = temperature_report(logits, val_set)
    head.save(train.output)
    (Path(train.output) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def temperature_report(logits: torch.Tensor, val_set: dict) -> dict[str, dict]:
    """Per label temperature of the validation tokens: the head's AUROC beside every single feature's,
    and its ECE raw and calibrated (cross-fitted Platt over all tokens, as the saved map)."""
    labels, temperatures = val_set["labels"], val_set["temperatures"]
    calibrated = cross_fitted_predictions(logits, labels)
    report = {}
    for t in sorted(temperatures.unique().tolist()):
        mask = temperatures == t
        report[f"{t:g}"] = {"tokens": int(mask.sum()), "mean_label": float(labels[mask].mean()),
                            "auroc": soft_label_auroc(logits[mask], labels[mask]),
                            "feature_auroc": feature_aurocs(val_set["scalars"][mask], labels[mask]),
                            "ece_raw": calibration(torch.sigmoid(logits[mask].double()), labels[mask]).ece,
                            "ece_calibrated": calibration(calibrated[mask], labels[mask]).ece}
    return report


def train_head(config: PipelineConfig, connect: Callable[[], None] | None = None) -> dict:
    """`specdec train-head`: check, start Ray (`connect`, checkpoints.connect_ray), cache features,
    train, save. Returns the training report."""
    train = config.require_train()
    # the run held first: a run another process trains is refused before the data are hashed
    with checkpoints.runs_held(train.storage, [train.name], "train"):
        manifest, identity, name = check_dataset(config)  # bad data and settings fail here, before Ray starts
        check_run(train, identity, manifest)
        manifest["dir"] = config.data.dir
        checkpoints.connect_ray(connect)
        features = ensure_features(config, manifest, identity)
        return save_result(fit_head(config, train, features), train, identity, name, manifest, features)


def select_run(runs: list[dict], metric: str) -> dict:
    """The run with the best final `val_<metric>` (lower is better but for AUROC); NaN never wins."""
    scored = [r for r in runs if not math.isnan(r[f"val_{metric}"])]
    if not scored:
        raise SpecDecError(f"no sweep run has a defined validation {metric}")
    return (max if SELECT_BY[metric] == "max" else min)(scored, key=lambda r: r[f"val_{metric}"])


def sweep_heads(config: PipelineConfig, connect: Callable[[], None] | None = None) -> dict:
    """`specdec train-head --sweep`: one run per (D, w_rej) on the same cached features; the head
    with the best final validation metric (`sweep.select_by`) is saved to `train.output`.

    The shipped configs choose by AUROC: w_rej > 1 shifts predictions down on purpose, so calibration
    metrics (KL, ECE) always favour w_rej = 1, while the threshold h, chosen later on validation
    prompts, can absorb a shift but not a poor ranking."""
    train = config.require_train()
    sweep, runs, metric = config.sweep, [], config.sweep.select_by
    grid = [train.model_copy(update={"depth": depth, "w_rej": w_rej, "name": f"{train.name}-D{depth}-wrej{w_rej:g}",
                                     "output": str(Path(train.output) / "sweep" / f"D{depth}-wrej{w_rej:g}")})
            for depth in sweep.depths for w_rej in sweep.w_rej]
    # train.name too: a plain run of it writes train.output, as the sweep's choice does; held before
    # the data are hashed, as train_head holds its run
    with checkpoints.runs_held(train.storage, [train.name] + [run.name for run in grid], "train"):
        manifest, identity, name = check_dataset(config)
        for run in grid:
            check_run(run, identity, manifest)
        manifest["dir"] = config.data.dir
        checkpoints.connect_ray(connect)
        features = ensure_features(config, manifest, identity)
        for run in grid:
            report = save_result(fit_head(config, run, features), run, identity, name, manifest, features)
            value = report["epochs"][-1][f"val_{metric}"]
            runs.append({"depth": run.depth, "w_rej": run.w_rej, "output": run.output, f"val_{metric}": value,
                         **{k: report["epochs"][-1][k] for k in ("val_kl", "val_auroc", "val_ece", "val_loss")}})
        best = select_run(runs, metric)
        chosen = train.model_copy(update={"depth": best["depth"], "w_rej": best["w_rej"]})
        from specdec.head import load_head

        load_head(best["output"]).save(chosen.output)
        summary = {"select_by": metric, "best": best, "runs": runs}
        report = json.loads((Path(best["output"]) / REPORT_FILE).read_text())
        report["sweep"] = summary
        (Path(chosen.output) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        return summary
