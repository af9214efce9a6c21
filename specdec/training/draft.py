"""`specdec train-draft`: the feature draft (models/feature_draft.py) trained with Ray Train on a
`features` dataset (training/data.py), resumable.

1. Checks, before Ray starts: the dataset is a features one, made on the configured target (its
   identity), and has sequences in both splits; a run name resumes only the settings it started with.
2. The trimmed vocabulary: the fewest ids that cover `vocab_coverage` of the train responses'
   tokens (most frequent first); or, where `init` names a saved draft to start from, its weights
   and vocabulary.
3. `TorchTrainer` with `train_loop`: batches of sequences, `steps` draft steps unrolled on the
   draft's own states (`FeatureDraft.unroll`), the loss at step j and position p the cross-entropy
   KL from the target's distribution of the same token to the draft's q (soft targets: the target's
   output state at p + 1 through its LM head's trimmed rows), weighted step_decay^(j-1), and
   `prompt_weight` where the token predicted is a prompt's. bfloat16 autocast on CPU (where the CPU has
   bfloat16 matmuls, several times fp32's) and on CUDA. A checkpoint every `checkpoint_every` optimizer
   steps; a rerun resumes from the last.
4. Validation per draft step on the held-out prompts, code and prose apart: greedy acceptance
   teacher-forced (the draft's argmax equals the target's greedy token, the earlier tokens true).
5. The draft of the last checkpoint saved to `draft.output` with its report (report.json).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from specdec.errors import IncompatibleModelsError, SpecDecError
from specdec.models.feature_draft import FUSED, FeatureDraft, FeatureDraftConfig, layer_config_of, stored_inputs
from specdec.models.feature_files import (REPORT_FILE, WEIGHTS_FILE, read_config, save_feature_draft, target_tensors,
                                          unpack_states)
from specdec.training import checkpoints
from specdec.training.config import ConfigError, DraftTrainSection, PipelineConfig
from specdec.training.data import FEATURE_COLUMNS, FINISH_REFERENCE, SPLITS, DatasetError, read_manifest, read_shard

CHECKPOINTS_TO_KEEP = 2
PROSE_PREFIX = "prose:"  # prompt ids of the prose source (training/prose_prompts.py); the rest is code
# settings a run may change when it resumes (how long it runs, how often it saves)
RESUMABLE_CHANGES = ("epochs", "checkpoint_every")


@dataclass(frozen=True)
class StoredStates:
    """Where a sequence's states lie in its shard: read when a batch needs them, so that a dataset
    larger than memory trains (the default target's: ~7 MB a sequence). A read decodes the shard's
    states column (8 sequences), a fraction of a second against a training step's seconds."""

    path: Path
    row: int
    positions: int  # stored: prompt + response
    hidden: int
    keep: int  # the first `keep` positions (max_tokens)

    def read(self) -> torch.Tensor:
        data = read_shard(self.path, columns=("states",)).column("states")[self.row].as_py()
        return unpack_states(data, self.positions, self.hidden)[:self.keep]


@dataclass
class Example:
    """One sequence of a features dataset."""

    prompt_id: str
    split: str
    tokens: torch.Tensor  # [T] prompt + response ids
    prompt_length: int
    stored: torch.Tensor | StoredStates | None  # the states in memory, where to read them, or None (tokens only)
    own: bool = True  # the response is the target's own (not a reference answer: data.FINISH_REFERENCE)

    @property
    def states(self) -> torch.Tensor | None:
        """[T, layers + 1, H] bfloat16, the output state last."""
        return self.stored.read() if isinstance(self.stored, StoredStates) else self.stored

    @property
    def kind(self) -> str:
        return "prose" if self.prompt_id.startswith(PROSE_PREFIX) else "code"


StatesMode = Literal["load", "lazy", "skip"]


def load_examples(directory: str | Path, max_tokens: int, states: StatesMode = "load") -> tuple[dict, list[Example]]:
    """(manifest, examples) of every shard, each checked against the manifest's sha256, with the
    states loaded, read from the shard when used (`lazy`: `StoredStates`), or none (`skip`)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest.get("kind") != "features":
        raise DatasetError(f"dataset {directory} is not a features dataset (data.kind: features)")
    if not manifest.get("shards"):
        raise DatasetError(f"dataset {directory} has no shards yet; run `specdec gen-data`")
    hidden = manifest["target"]["hidden_size"]
    examples = []
    for entry in manifest["shards"]:
        path = directory / entry["file"]
        if not path.is_file():
            raise DatasetError(f"shard {path} listed in the manifest is missing")
        columns = FEATURE_COLUMNS if states == "load" else tuple(c for c in FEATURE_COLUMNS if c != "states")
        for index, row in enumerate(read_shard(path, entry.get("sha256"), columns=columns).to_pylist()):
            if not row["response_ids"]:
                continue
            ids = row["prompt_ids"] + row["response_ids"]
            stored = None
            if states == "load":
                stored = unpack_states(row["states"], len(ids), hidden)[:max_tokens]
            elif states == "lazy":
                stored = StoredStates(path, index, len(ids), hidden, max_tokens)
            examples.append(Example(row["prompt_id"], row["split"], torch.tensor(ids[:max_tokens]),
                                    len(row["prompt_ids"]), stored, row["finish_reason"] != FINISH_REFERENCE))
    return manifest, examples


def trimmed_vocabulary(examples: list[Example], coverage: float, minimum: int = 0) -> torch.Tensor:
    """The fewest ids covering `coverage` of the train responses' tokens (most frequent first), then
    the lowest ids not yet in until there are `minimum`: a BPE vocabulary numbers its tokens in merge
    order, so its low ids are the most frequent in the tokenizer's own corpus, which a few hundred
    responses cannot sample (docs/feature-draft.md). Sorted."""
    counts = Counter(t for e in examples if e.split == "train" for t in e.tokens[e.prompt_length:].tolist())
    total, kept, covered = sum(counts.values()), [], 0
    for token, n in counts.most_common():
        if covered >= coverage * total:
            break
        kept.append(token)
        covered += n
    chosen, next_id = set(kept), 0
    while len(chosen) < minimum:
        chosen.add(next_id)
        next_id += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage_of(examples: list[Example], vocab_ids: torch.Tensor, split: str) -> float:
    kept = set(vocab_ids.tolist())
    tokens = [t for e in examples if e.split == split for t in e.tokens[e.prompt_length:].tolist()]
    return sum(t in kept for t in tokens) / max(len(tokens), 1)


# -- one batch: inputs, soft targets, weights ----------------------------------------------------

@dataclass
class Batch:
    """B sequences padded on the right to T positions."""

    states: torch.Tensor  # [B, T, reads, H] what g_t reads
    outputs: torch.Tensor  # [B, T, H] the target's output state (soft targets)
    tokens: torch.Tensor  # [B, T] x_{t+1} at position t (shifted left; 0 past the end)
    next_ids: torch.Tensor  # [B, T] the token the target's state at t predicts (x_{t+1}); -1 past the end
    lengths: torch.Tensor  # [B]
    prompt_lengths: torch.Tensor  # [B]


def make_batch(examples: list[Example], inputs: str, layers: int, device) -> Batch:
    T = max(len(e.tokens) for e in examples)
    stored = [e.states for e in examples]  # read once each (a lazy example reads its shard)
    hidden = stored[0].shape[-1]
    reads = layers if inputs == FUSED else 1
    states = torch.zeros(len(examples), T, reads, hidden, dtype=torch.bfloat16)
    outputs = torch.zeros(len(examples), T, hidden, dtype=torch.bfloat16)
    tokens = torch.zeros(len(examples), T, dtype=torch.long)
    next_ids = torch.full((len(examples), T), -1, dtype=torch.long)
    for b, (e, e_states) in enumerate(zip(examples, stored)):
        n = len(e.tokens)
        states[b, :n] = stored_inputs(e_states, inputs, layers)
        outputs[b, :n] = e_states[:, -1]
        tokens[b, :n - 1] = e.tokens[1:]
        next_ids[b, :n - 1] = e.tokens[1:]
    return Batch(states.to(device), outputs.to(device), tokens.to(device), next_ids.to(device),
                 torch.tensor([len(e.tokens) for e in examples], device=device),
                 torch.tensor([e.prompt_length for e in examples], device=device))


def batch_loss(model: FeatureDraft, batch: Batch, draft: DraftTrainSection) -> tuple[torch.Tensor, dict]:
    """The weighted KL from the target's distribution to the draft's over the unrolled steps (the
    soft-target cross-entropy less a constant), and per-step greedy (matches, positions). Only the
    positions with a weight reach the vocabulary's scores: at 32k ids those are most of a step's work."""
    device_type = batch.tokens.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16):
        outs = model.unroll(batch.states, batch.tokens, draft.steps)
    weights = [step_weights(batch, j, draft) for j in range(1, draft.steps + 1)]  # [B, T - 1] each
    first = weights[0].nonzero(as_tuple=True)  # every later step's positions are among step 1's
    row_of = torch.full(weights[0].shape, -1, dtype=torch.long, device=weights[0].device)
    row_of[first] = torch.arange(len(first[0]), device=row_of.device)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        # the target's distribution at p + 1 over the trimmed vocabulary: what every step at p must match
        target_logits = model.lm_head(batch.outputs[:, 1:][first])  # [N, V_trim]
    target_logp = torch.log_softmax(target_logits.float(), dim=-1)
    target_p = target_logp.exp()
    truth = batch.next_ids[:, 1:]  # [B, T - 1] the token at p + 2 (-1 past the end)
    response = predicts_response(batch)[:, :-1]
    total, weight_sum, stats = 0.0, 0.0, {}
    for j, (out, w) in enumerate(zip(outs, weights), start=1):
        rows = w.nonzero(as_tuple=True)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            logits = model.logits(out[:, :-1][rows])  # [n, V_trim]: step j at p drafts what the target's p + 1 predicts
        log_q = torch.log_softmax(logits.float(), dim=-1)
        index = row_of[rows]
        kl = (target_p[index] * (target_logp[index] - log_q)).sum(-1)  # [n] KL(p || q)
        total = total + (kl * w[rows]).sum()
        weight_sum += float(w[rows].sum())
        drafted = model.vocab_ids[logits.argmax(-1)]
        counted = response[rows] & (truth[rows] >= 0)  # greedy acceptance: response tokens the data hold
        stats[j] = (int(((drafted == truth[rows]) & counted).sum()), int(counted.sum()))
    return total / max(weight_sum, 1e-9), stats


def predicts_response(batch: Batch) -> torch.Tensor:
    """[B, T]: the state at p drafts a response token (p + 2 past the prompt)."""
    p = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)[None, :]
    return p + 2 >= batch.prompt_lengths[:, None]


def step_weights(batch: Batch, step: int, draft: DraftTrainSection) -> torch.Tensor:
    """[B, T - 1] the loss weight of draft step `step` (1-based) at each position p: its state drafts
    the token at p + 2 (the target's distribution at p + 1 is its soft target); 0 where the round's
    target features would end before the sequence (p - step + 1 < 0) or p + 1 is past its end;
    `prompt_weight` where the token drafted is a prompt's; times step_decay^(step - 1)."""
    p = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)[None, :]
    valid = (p >= step - 1) & (p + 1 <= batch.lengths[:, None] - 1)
    response = predicts_response(batch)
    w = (valid & response).float() + draft.prompt_weight * (valid & ~response).float()
    return w[:, :-1] * draft.step_decay ** (step - 1)


# -- the Ray Train loop --------------------------------------------------------------------------

def draft_config(draft: DraftTrainSection, identity: str, name: str, layers: list[int], target_config
                 ) -> FeatureDraftConfig:
    """The config of the draft a run trains on the target (`target_config`, its transformers config)."""
    return FeatureDraftConfig(target_identity=identity, target_name=name, inputs=draft.inputs,
                              layers=layers if draft.inputs == FUSED else [],
                              layer_config=layer_config_of(target_config, draft.intermediate_size),
                              vocab_size=target_config.vocab_size)


def build_draft(settings: dict, target_dir: str, vocab_ids: torch.Tensor) -> FeatureDraft:
    from transformers import AutoConfig

    config = draft_config(DraftTrainSection(**settings["draft"]), settings["target_identity"], settings["target_name"],
                          settings["layers"], AutoConfig.from_pretrained(target_dir))
    embed, head = target_tensors(target_dir, vocab_ids, torch.bfloat16)
    return FeatureDraft(config, embed, head, vocab_ids)


def learning_rate(step: int, total: int, draft: DraftTrainSection) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < draft.warmup_steps:
        return draft.lr * (step + 1) / draft.warmup_steps
    progress = (step - draft.warmup_steps) / max(total - draft.warmup_steps, 1)
    return draft.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def validate(model: FeatureDraft, examples: list[Example], draft: DraftTrainSection, layers: int, device) -> dict:
    """Per step and kind (code, prose): teacher-forced greedy acceptance; and the mean loss."""
    model.eval()
    counts: dict[str, list[int]] = {}
    losses = []
    with torch.no_grad():
        for start in range(0, len(examples), draft.batch_size):
            chunk = examples[start:start + draft.batch_size]
            for kind in ("code", "prose"):
                part = [e for e in chunk if e.kind == kind]
                if not part:
                    continue
                loss, stats = batch_loss(model, make_batch(part, draft.inputs, layers, device), draft)
                losses.append(float(loss))
                for j, (hit, n) in stats.items():
                    key = f"{kind}_step{j}"
                    counts.setdefault(key, [0, 0])
                    counts[key][0] += hit
                    counts[key][1] += n
    model.train()
    metrics = {f"val_acc_{key}": hit / max(n, 1) for key, (hit, n) in counts.items()}
    metrics["val_loss"] = sum(losses) / max(len(losses), 1)
    return metrics


def epoch_examples(examples: list[Example], draft: DraftTrainSection) -> list[Example]:
    """An epoch's train sequences: each of the target's own responses `own_repeats` times."""
    return [e for e in examples if e.split == "train" for _ in range(draft.own_repeats if e.own else 1)]


def epoch_order(lengths: list[int], draft: DraftTrainSection, epoch: int) -> list[int]:
    """The train sequences' order in an epoch (a permutation, the same for a seed and epoch, so that a
    resumed run continues it): shuffled, or with `group_by_length` shuffled in groups of 50 batches,
    each group sorted by length (transformers' `get_length_grouped_indices`, as its Trainer's
    `group_by_length`), so that each batch holds sequences of like length."""
    generator = torch.Generator().manual_seed(draft.seed + epoch)
    if not draft.group_by_length:
        return torch.randperm(len(lengths), generator=generator).tolist()
    from transformers.trainer_pt_utils import get_length_grouped_indices

    return [int(i) for i in get_length_grouped_indices(lengths, draft.batch_size, generator=generator)]


def train_loop(loop_config: dict) -> None:
    """Runs on every Ray Train worker: data parallel over sequences, a checkpoint every
    `checkpoint_every` optimizer steps and at the end of each epoch."""
    import ray.train
    import ray.train.torch

    draft = DraftTrainSection(**loop_config["draft"])
    if loop_config.get("threads"):  # Ray sets one OpenMP thread per CPU it reserved; the config may say more
        torch.set_num_threads(loop_config["threads"])
    vocab_ids = torch.tensor(loop_config["vocab_ids"], dtype=torch.long)
    _, examples = load_examples(loop_config["data_dir"], draft.max_tokens, states="lazy")
    layers = len(loop_config["layers"])
    train_set = epoch_examples(examples, draft)
    val_set = [e for e in examples if e.split == "validation"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(draft.seed)
    model = build_draft(loop_config, loop_config["target_dir"], vocab_ids)
    device = ray.train.torch.get_device()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=draft.lr, weight_decay=draft.weight_decay)
    if draft.init:  # a checkpoint of this run, if any, replaces it below
        model.load_own_state(init_state(draft.init))
    step, history = checkpoints.resume(model.load_own_state, optimizer, "model", "step")
    model = ray.train.torch.prepare_model(model)
    core = model.module if hasattr(model, "module") else model
    per_epoch = len(train_set) // (draft.batch_size * world)
    total = per_epoch * draft.epochs
    started, running = time.perf_counter(), []

    def save(metrics: dict) -> None:
        history.append(metrics)
        if rank == 0:
            accepted = " ".join(f"{k.removeprefix('val_acc_')} {v:.3f}" for k, v in metrics.items()
                                if k.startswith("val_acc_"))
            print(f"train-draft step {step}/{total} ({metrics['seconds']:.0f} s): train loss "
                  f"{metrics['train_loss']:.4f}{'; validation acceptance ' + accepted if accepted else ''}", flush=True)
        checkpoints.report(metrics, {"model": core.own_state(), "optimizer": optimizer.state_dict(), "step": step},
                           history, rank)

    while step < total:
        epoch, within = divmod(step, per_epoch)
        order = epoch_order([len(e.tokens) for e in train_set], draft, epoch)
        mine = order[rank * per_epoch * draft.batch_size:(rank + 1) * per_epoch * draft.batch_size]
        for index in range(within, per_epoch):
            chunk = [train_set[i] for i in mine[index * draft.batch_size:(index + 1) * draft.batch_size]]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total, draft)
            loss, _ = batch_loss(core, make_batch(chunk, draft.inputs, layers, device), draft)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            step += 1
            running.append(float(loss.detach()))
            end_of_epoch = index == per_epoch - 1
            if step % draft.checkpoint_every == 0 or end_of_epoch or step == total:
                metrics = {"step": step, "epoch": step / per_epoch, "train_loss": sum(running) / len(running),
                           "seconds": time.perf_counter() - started}
                running = []
                if end_of_epoch or step == total:
                    metrics.update(validate(core, val_set, draft, layers, device))
                save(metrics)


# -- the job -------------------------------------------------------------------------------------

def check_draft_data(config: PipelineConfig) -> tuple[dict, str, str]:
    """(manifest, target identity, target dir) after checking the data were made on the configured
    target; one-line errors, no Ray."""
    from specdec.errors import ModelSourceError
    from specdec.models.sources import model_identity, resolve_model

    draft = config.require_draft()
    if draft.init:  # named by its key, before the data load
        try:
            read_config(draft.init)
        except ModelSourceError as exc:
            raise ConfigError(f"draft.init: {exc}") from None
    manifest = read_manifest(Path(config.data.dir))
    if manifest.get("kind") != "features":
        raise DatasetError(f"dataset {config.data.dir} is not a features dataset (data.kind: features)")
    try:
        target_dir = resolve_model(config.models.target, role="target", cache=config.models.cache_dir)
    except ModelSourceError as exc:
        raise ModelSourceError(f"models.target: {exc}") from None
    identity = model_identity(target_dir)
    made_on = manifest.get("settings", {}).get("target_identity")
    if made_on != identity:
        raise IncompatibleModelsError(f"dataset {config.data.dir} was made on another target ({str(made_on)[:24]}), "
                                      f"not models.target {config.models.target!r} ({identity[:24]})")
    splits = {s: manifest["counts"].get(f"{s}_sequences", 0) for s in SPLITS}
    if not splits["train"] or not splits["validation"]:
        raise SpecDecError(f"dataset {config.data.dir} needs sequences in both splits "
                           f"(train {splits['train']}, validation {splits['validation']})")
    return manifest, identity, str(target_dir)


def init_state(directory: str) -> dict[str, torch.Tensor]:
    """A saved draft's own weights in float32 (training's master copy)."""
    from safetensors.torch import load_file

    return {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(Path(directory) / WEIGHTS_FILE)).items()}


def init_vocabulary(draft: DraftTrainSection, identity: str, layers: list[int], target_config) -> torch.Tensor:
    """The vocabulary of the draft a run starts from, after checking it is this run's kind of draft."""
    found = read_config(draft.init)
    made = draft_config(draft, identity, "", layers, target_config)
    wanted = type(made).model_validate_json(made.model_dump_json())  # as read back from a config.json
    differs = sorted(k for k in ("target_identity", "inputs", "layers", "layer_config")
                     if getattr(found, k) != getattr(wanted, k))
    if differs:
        raise ConfigError(f"draft.init {draft.init} is another kind of draft ({', '.join(differs)} differ)")
    return init_state(draft.init)["vocab_ids"]


def check_trainable(draft: DraftTrainSection, workers: int, examples: list[Example], target_vocab: int) -> None:
    """What would fail in the workers, refused before Ray starts (ConfigError): an epoch without a
    batch, a trimmed vocabulary past the target's or without a token."""
    sequences = len(epoch_examples(examples, draft))
    if sequences < draft.batch_size * workers:
        raise ConfigError(f"draft.batch_size {draft.batch_size} x scaling.num_workers {workers} is more than the "
                          f"{sequences} train sequences: an epoch would hold no batch")
    if draft.vocab_size > target_vocab:
        raise ConfigError(f"draft.vocab_size {draft.vocab_size} is more than the target's {target_vocab} tokens")
    if not (draft.init or draft.vocab_size) and not any(
            len(e.tokens) > e.prompt_length for e in examples if e.split == "train"):
        raise ConfigError(f"no train response token within draft.max_tokens {draft.max_tokens}: "
                          "no vocabulary to draft")


def train_draft(config: PipelineConfig, connect: Callable[[], None] | None = None) -> dict:
    """`specdec train-draft`: check, choose the vocabulary, start Ray (`connect`,
    checkpoints.connect_ray), train, save. Returns the report."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    draft = config.require_draft()
    # the run held first: a run another process trains is refused before the data are hashed
    with checkpoints.runs_held(draft.storage, [draft.name], "draft"):
        manifest, identity, target_dir = check_draft_data(config)
        data_dir = str(Path(config.data.dir).resolve())
        _, examples = load_examples(data_dir, draft.max_tokens, states="skip")  # the workers read the states
        check_trainable(draft, config.scaling.num_workers, examples, manifest["target"]["vocab_size"])
        if draft.init:
            from transformers import AutoConfig

            vocab_ids = init_vocabulary(draft, identity, manifest["settings"]["layers"],
                                        AutoConfig.from_pretrained(target_dir))
        else:
            vocab_ids = trimmed_vocabulary(examples, draft.vocab_coverage, draft.vocab_size)
        data_settings = {**manifest["settings"], "sequences": manifest["counts"]["sequences"]}
        checkpoints.check_run_settings(draft.storage, draft.name, "draft", draft, RESUMABLE_CHANGES, data_settings)
        checkpoints.connect_ray(connect)
        scaling = config.scaling
        loop_config = {"draft": draft.model_dump(), "vocab_ids": vocab_ids.tolist(), "data_dir": data_dir,
                       "layers": manifest["settings"]["layers"], "target_dir": target_dir, "target_identity": identity,
                       "target_name": config.models.target, "threads": config.scaling.threads}
        trainer = TorchTrainer(
            train_loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=scaling.num_workers, use_gpu=scaling.use_gpu,
                                         resources_per_worker={"CPU": scaling.cpus_per_worker}),
            run_config=RunConfig(name=draft.name, storage_path=str(Path(draft.storage).resolve()),
                                 checkpoint_config=CheckpointConfig(num_to_keep=CHECKPOINTS_TO_KEEP)))
        result = checkpoints.fit(trainer)
        state, history, _ = checkpoints.read_final(result, draft.name)
        model = build_draft(loop_config, target_dir, vocab_ids)
        model.load_own_state(state["model"])
        save_feature_draft(model, draft.output)
        report = {"draft": draft.model_dump(), "data": {"dir": config.data.dir, "counts": manifest["counts"],
                                                        "layers": manifest["settings"]["layers"],
                                                        "prompt_source": manifest.get("prompt_source")},
                  "vocabulary": {"ids": len(vocab_ids), "coverage_train": coverage_of(examples, vocab_ids, "train"),
                                 "coverage_validation": coverage_of(examples, vocab_ids, "validation")},
                  "parameters": sum(p.numel() for p in model.parameters()), "history": history,
                  "final": history[-1] if history else {}}
        (Path(draft.output) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        return report
