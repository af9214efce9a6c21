"""Training data for the acceptance head (paper §3.3), generated on Ray workers, resumable.

For every prompt (`data.prompts.source`: stdlib_prompts, prose_prompts, package_prompts; never
HumanEval):

1. the target's response X_1..X_N, written by the project's lossless engine (its output follows
   the target's distribution exactly, and it is faster than the target alone); a shard's prompts
   are generated together, in one batch on the engine's batched core;
2. p_i at every position: the target's logits from the verification passes that wrote X (every
   committed token is a row of some pass, scored after exactly X_<i: `RecordingTarget`), so the
   target never runs twice; q_i: one teacher-forced pass of the (unquantized) draft over prompt + X;
3. label sets (`data.labels`): per temperature, Y_i ~ q_i per position and the soft label
   P_i = min(1, p_i(Y_i) / q_i(Y_i)) (labels.py), p and q through that temperature's transform
   (temperature 0: one-hot argmax, exact match), `draws` independent Y per sampled temperature.
   p and q are computed once: a further set costs a sampling step, not a forward pass.

Responses already made for the same target and response settings (an older dataset: `reuse`) are
labelled again instead of regenerated; their p_i then comes from one teacher-forced target pass,
which means the same as the recorded rows (tests/core/training/test_data.py).

Layout of `data.dir`:

    manifest.json          models (identities), settings, prompt source, shards with sha256, counts
    shard-00000.parquet    one row per prompt: prompt_id, split, prompt_ids, response_ids (X),
    shard-00001.parquet    label_temperatures [L], draft_ids (Y) [L][N], labels (P) [L][N],
    ...                    finish_reason, seed

Shards hold token ids and labels only (a few bytes per token); the draft's hidden states are
computed at training time (train.py), because they depend on the mixing draw and are ~1000x larger.

The `features` kind (`data.kind`) is the feature draft's data (models/feature_draft.py, trained by
training/draft.py): the same prompts, responses, resume and checks, and instead of labels the
target's own states at every position of prompt + response, from one teacher-forced pass: after the
decoder layers `data.features.layers` and its output state (the final norm's), bfloat16:

    shard-00000.parquet    one row per prompt: prompt_id, split, prompt_ids, response_ids,
    ...                    finish_reason, seed, states (bytes of [T, layers + 1, H] bfloat16)

A features dataset depends on the target alone (no draft identity, no labels in its settings).
The states' pass runs on the target as the engine runs it, or on a bfloat16 copy of it
(`data.features.compute`: half the time on a CPU with AVX-512 BF16, within bfloat16's rounding of
the float32 states they are stored as anyway); each shard records which in its metadata.

Reference answers (`data.response.reference`, features data only): a train prompt whose source has
a reference answer (the stdlib and package prompts: the function's own code, one fenced block) takes it as its
response, cut at `max_new_tokens` (ending with the end-of-turn token where it fits), with
finish_reason "reference". Such a row costs one teacher-forced pass instead of a decode of the
target (one pass over the weights instead of one a token), and the feature draft's loss reads
the target's own distribution at every position of whatever text it is fed (training/draft.py), so
the text need not be the target's. Validation prompts, prompts without a reference and reused
responses keep the target's own response: held-out figures stay on the target's text. A dataset
made without references continues with them (each of its rows is one a reference run could make),
and a dataset continues with sources added to its list (each source splits its prompts on its own).

Resume: a shard is written to a temporary name and renamed, so a shard on disk is complete; a
rerun reads the prompt ids of every shard, skips those prompts, and rebuilds the manifest from the
shards on disk. A rerun with other models or settings into the same directory is refused.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import IncompatibleModelsError, ModelSourceError, SpecDecError, one_line
from specdec.files import held, write_atomically
from specdec.models.feature_files import pack_states
from specdec.models.vocab import SETTINGS_BEFORE_DRAFT_VOCAB, vocab_setting
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.training import checkpoints
from specdec.training.config import DataSection, ModelsSection, PipelineConfig, PromptsSection, TrainSection
from specdec.training.labels import sample_draft_tokens, soft_acceptance_labels
from specdec.training.stdlib_prompts import Prompt

# 1: one label set per row (draft_ids [N], labels [N]), an int8 draft on CPU. 2: label sets [L][N].
FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
LOCK_FILE = "gen-data.lock"  # held by the gen-data writing the folder
SHARD_PREFIX, SHARD_SUFFIX = "shard-", ".parquet"
SPLITS = ("train", "validation")
SHARD_COLUMNS = ("prompt_id", "split", "prompt_ids", "response_ids", "label_temperatures", "draft_ids", "labels",
                 "finish_reason", "seed")
FEATURE_COLUMNS = ("prompt_id", "split", "prompt_ids", "response_ids", "finish_reason", "seed", "states")
KIND_COLUMNS = {"labels": SHARD_COLUMNS, "features": FEATURE_COLUMNS}
# what the manifest's entry of a shard reads (a features shard's states are megabytes)
ENTRY_COLUMNS = {"labels": ("prompt_id", "split", "response_ids", "labels"),
                 "features": ("prompt_id", "split", "prompt_ids", "response_ids")}
SEED_BITS = 63
logger = logging.getLogger(__name__)
FINISH_TOO_LONG = "prompt_too_long"  # a row with no response: over max_prompt_tokens or the models' context
WORKER_RESTARTS = 3  # per gen-data worker, then the run stops (rerun it: it resumes from the shards)
FINISH_REFERENCE = "reference"  # a row whose response is the prompt's reference answer, not the target's
STATES_COMPUTE = "states_compute"  # a features shard's metadata key and manifest entry (FeaturesSection.compute)


class DatasetError(SpecDecError):
    """A data directory that cannot be used: missing or foreign manifest, empty or corrupt shard."""


@dataclass(frozen=True)
class LabelSet:
    temperature: float
    draft_ids: list[int]  # Y_1..Y_N, Y_i ~ q(. | prompt, X_<i) through this temperature's transform
    labels: list[float]  # P_i = min(1, p_i(Y_i) / q_i(Y_i))


@dataclass(frozen=True)
class Reused:
    """A response made earlier for the same prompt, target and response settings."""

    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str


def takes_reference(response, prompt: Prompt) -> bool:
    """Whether `prompt`'s response is its reference answer (see "Reference answers" above)."""
    return response.reference and prompt.split == "train" and prompt.reference is not None


def response_settings(response) -> dict:
    """The response settings a dataset records; `reference` only when on, so that a dataset made
    before the key existed records what one made without it does."""
    return response.model_dump(exclude=set() if response.reference else {"reference"})


# -- the math of one example ---------------------------------------------------------------------

def label_distribution(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> the distributions verification compares: one-hot argmax when greedy
    (labels then mean exact match), else `probs_from_logits`."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return probs_from_logits(logits, sampling)


@torch.inference_mode()
def response_logits(model, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
    """Teacher-forced next-token logits [N, V] fp32 at the N response positions: row i is the
    model's distribution of X_{i+1} given prompt + X_1..X_i (one forward pass, no cache).

    Worked example: prompt [a b], X [x1 x2 x3]: feed [a b x1 x2]; rows come from the outputs at
    b, x1, x2 (the last 3 positions)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids[:-1])], dtype=torch.long, device=device)
    hidden = model.model(input_ids=ids).last_hidden_state[0, -len(response_ids):]  # [N, H]
    return model.lm_head(hidden).float()  # [N, V]


def label_response(draft_model, target_model, prompt_ids: Sequence[int], response_ids: Sequence[int],
                   sets: Sequence[SamplingParams], generator: torch.Generator,
                   target_logits: torch.Tensor | None = None) -> list[LabelSet]:
    """One LabelSet per entry of `sets`, in order, all from one draft pass (and one target pass when
    `target_logits` [N, V], the target's logits at the response positions, are not known already)."""
    q_logits = response_logits(draft_model, prompt_ids, response_ids).cpu()  # [N, V]
    if target_logits is None:
        target_logits = response_logits(target_model, prompt_ids, response_ids)
    return label_sets(q_logits, target_logits.float().cpu(), sets, generator)


def label_sets(q_logits: torch.Tensor, p_logits: torch.Tensor, sets: Sequence[SamplingParams],
               generator: torch.Generator) -> list[LabelSet]:
    """One LabelSet per entry of `sets` from the draft's and the target's logits [N, V] at the
    response positions: Y_i ~ q_i through the set's transform, P_i against p_i."""
    out, distributions = [], {}
    for sampling in sets:
        key = (sampling.temperature, sampling.top_p, sampling.top_k)
        if key not in distributions:
            distributions[key] = label_distribution(q_logits, sampling), label_distribution(p_logits, sampling)
        q, p = distributions[key]  # [N, V] each
        y = sample_draft_tokens(q, generator)  # [N]
        out.append(LabelSet(sampling.temperature, y.tolist(), soft_acceptance_labels(p, q, y).tolist()))
    return out


class RecordingTarget:
    """A TargetRuntime that keeps every verification pass's logits with the history it scored after,
    so the logits of a committed response can be read back (`committed_logits`), for any number of
    sequences in one batch."""

    def __init__(self, target):
        self.target, self.calls = target, []  # calls: [(history, logits [K+1, V])]

    def __getattr__(self, name: str):
        return getattr(self.target, name)

    def score(self, sessions: list, histories: list[list[int]], candidates: list[list[int]]) -> list[torch.Tensor]:
        rows = self.target.score(sessions, histories, candidates)
        self.calls.extend((tuple(history), logits) for history, logits in zip(histories, rows))
        return rows

    def committed_logits(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
        """[N, V]: row i is the target's logits for response token X_{i+1}, i.e. after prompt + X_1..X_i.

        The passes of this response are those whose history is prompt + a prefix of X. Worked example:
        prompt of 5 tokens; round 1 scored after h=5 with rows for positions 5..8 and committed 3
        tokens (absolute 5, 6, 7); round 2 scored after h=8. Position 7 comes from round 1 row 2;
        position 8 from round 2 row 0: the last pass with h <= position is the one that committed it
        (every pass starts right after the committed history)."""
        sequence = tuple(prompt_ids) + tuple(response_ids)
        mine = [(len(h), x) for h, x in self.calls if len(h) <= len(sequence) and sequence[:len(h)] == h]
        rows = []
        for position in range(len(prompt_ids), len(sequence)):
            start, logits = next((h, x) for h, x in reversed(mine) if h <= position)
            rows.append(logits[position - start])
        return torch.stack(rows)


def prompt_seed(base_seed: int, prompt_id: str) -> int:
    """A seed per prompt that does not depend on which worker or which run handles it."""
    digest = hashlib.sha256(f"{base_seed}\0{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << SEED_BITS) - 1)


# -- a worker: the engine plus teacher forcing --------------------------------------------------

class ExampleWriter:
    """Builds the engine once and turns prompts into shard rows (a Ray actor in `generate_dataset`)."""

    def __init__(self, models: ModelsSection, data: DataSection, threads: int | None = None):
        from specdec.builder import build_engine

        if threads:
            torch.set_num_threads(threads)
        self.models, self.data, self.refused = models, data, None
        try:
            self.engine = build_engine(models.engine_config(threads), progress=False)
        except SpecDecError as error:  # the config's fault: raised by `rows`, whose task error the driver
            self.refused = error       # prints in one line (an actor that fails to start dies with a traceback)
            return
        self.target = self.engine.verifier_worker.target = RecordingTarget(self.engine.target)

    def rows(self, prompts: Sequence[Prompt], reused: dict[str, Reused] | None = None) -> list[dict]:
        """Shard rows for `prompts`: the new responses generated together in one batch; a prompt in
        `reused` with the same prompt tokens keeps its response."""
        from specdec.params import GenerationParams

        if self.refused is not None:
            raise self.refused
        reused, response = reused or {}, self.data.response
        limit = min(self.data.prompts.max_prompt_tokens, self.engine.max_context - 1)
        rows, to_generate = [], []
        for prompt in prompts:
            seed = prompt_seed(self.data.seed, prompt.id)
            prompt_ids = self.engine.encode_prompt(prompt.text)
            rows.append({"prompt_id": prompt.id, "split": prompt.split, "prompt_ids": prompt_ids, "response_ids": [],
                         "label_temperatures": [], "draft_ids": [], "labels": [], "finish_reason": FINISH_TOO_LONG,
                         "seed": seed})
            old = reused.get(prompt.id)
            if len(prompt_ids) > limit:  # kept as a row without a response: resume skips it
                continue
            if old is not None and old.prompt_ids == prompt_ids:
                rows[-1].update(response_ids=old.response_ids, finish_reason=old.finish_reason)
            elif takes_reference(response, prompt):
                rows[-1].update(response_ids=self.reference_ids(prompt.reference), finish_reason=FINISH_REFERENCE)
            else:
                to_generate.append(rows[-1])
        self.target.calls.clear()
        if to_generate:
            params = [GenerationParams(max_new_tokens=response.max_new_tokens, sampling=response.sampling(row["seed"]),
                                       policy=response.policy_config()) for row in to_generate]
            results = self.engine.generate_many([row["prompt_ids"] for row in to_generate], params)
            for row, result in zip(to_generate, results):
                completion = result.completions[0]
                row.update(response_ids=completion.token_ids, finish_reason=completion.finish_reason)
        generated = {id(row) for row in to_generate}
        for row in rows:
            if row["response_ids"]:
                self.annotate(row, generated=id(row) in generated)
        self.target.calls.clear()
        return rows

    def reference_ids(self, text: str) -> list[int]:
        """A reference answer as response tokens: cut at max_new_tokens, closed with the end-of-turn
        token where it fits (as a finished response of the target is)."""
        limit = self.data.response.max_new_tokens
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)[:limit]
        return ids + [self.end_of_turn] if len(ids) < limit else ids

    @functools.cached_property
    def end_of_turn(self) -> int:
        """The stop token that closes an answer in the chat template (Qwen's <|im_end|>), else the first."""
        tokenizer, stops = self.engine.tokenizer, sorted(self.engine.eos_token_ids)
        if getattr(tokenizer, "chat_template", None):
            turn = tokenizer.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}],
                                                 tokenize=True, return_dict=False)
            return next((i for i in turn if i in stops), stops[0])
        return stops[0]

    def annotate(self, row: dict, generated: bool) -> None:
        """Label sets of a row with a response (its target logits recorded when it was just generated)."""
        target_logits = self.target.committed_logits(row["prompt_ids"], row["response_ids"]) if generated else None
        sets = label_response(self.engine.draft.model, self.target.model, row["prompt_ids"], row["response_ids"],
                              self.data.labels.sets(), torch.Generator().manual_seed(row["seed"]), target_logits)
        row.update(label_temperatures=[s.temperature for s in sets], draft_ids=[s.draft_ids for s in sets],
                   labels=[s.labels for s in sets])


@torch.inference_mode()
def target_states(model, token_ids: Sequence[int], layers: Sequence[int]) -> torch.Tensor:
    """[T, len(layers) + 1, H] bfloat16: the hidden states after each decoder layer in `layers` and the
    output state (after the final norm) at every position of `token_ids`, from one forward pass."""
    caught = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda module, args, out, i=i: caught.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layers]
    try:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=next(model.parameters()).device)
        final = model.model(input_ids=ids).last_hidden_state  # [1, T, H]
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([caught[i][0] for i in layers] + [final[0]], dim=1).to(torch.bfloat16).cpu()


class FeatureWriter(ExampleWriter):
    """The `features` kind: the target's states over prompt + response instead of labels."""

    def annotate(self, row: dict, generated: bool) -> None:
        ids = list(row["prompt_ids"]) + list(row["response_ids"])
        row["states"] = pack_states(target_states(self.states_model, ids, self.data.features.layers))

    @functools.cached_property
    def states_model(self):
        """The model of the states' pass: the target's, or a bfloat16 copy (`data.features.compute`)."""
        model = self.target.model
        if self.data.features.compute == "target" or next(model.parameters()).dtype == torch.bfloat16:
            return model
        from transformers import AutoModelForCausalLM

        from specdec.models.sources import resolve_model

        target_dir = resolve_model(self.models.target, role="target", cache=self.models.cache_dir, progress=False)
        return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(model.device).eval()


# -- shards and the manifest ---------------------------------------------------------------------

def shard_schema(kind: str = "labels"):
    import pyarrow as pa

    common = [("prompt_id", pa.string()), ("split", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
              ("response_ids", pa.list_(pa.int32()))]
    if kind == "features":
        return pa.schema(common + [("finish_reason", pa.string()), ("seed", pa.int64()), ("states", pa.binary())])
    return pa.schema(common + [("label_temperatures", pa.list_(pa.float32())),
                               ("draft_ids", pa.list_(pa.list_(pa.int32()))), ("labels", pa.list_(pa.list_(pa.float32()))),
                               ("finish_reason", pa.string()), ("seed", pa.int64())])


def write_shard(directory: Path, index: int, rows: list[dict], kind: str = "labels",
                states_compute: str | None = None) -> Path:
    """Write rows as shard `index`, atomically (temporary name, then rename). `states_compute`: how a
    features shard's states were computed (`FeaturesSection.compute`), kept in the file's metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = directory / f"{SHARD_PREFIX}{index:05d}{SHARD_SUFFIX}"
    partial = path.with_name(path.name + ".partial")
    rows = [{name: row.get(name) for name in KIND_COLUMNS[kind]} for row in rows]
    schema = shard_schema(kind).with_metadata({STATES_COMPUTE: states_compute} if states_compute else None)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), partial)
    os.replace(partial, path)
    return path


def shard_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}"))


def read_shard(path: Path, expected_sha256: str | None = None, columns: Sequence[str] = SHARD_COLUMNS):
    """The shard's `columns`; DatasetError (one line) when it is empty, corrupt or not a shard."""
    import pyarrow.parquet as pq

    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise DatasetError(f"shard {path} is corrupt: its sha256 differs from the manifest's")
    try:
        table = pq.read_table(path, columns=[c for c in columns if c in pq.read_schema(path).names])
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DatasetError(f"shard {path} is corrupt or not parquet: {one_line(exc)}") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DatasetError(f"shard {path} is not a training shard (missing columns: {', '.join(missing)})")
    if table.num_rows == 0:
        raise DatasetError(f"shard {path} is empty")
    return table.select(list(columns))


def shard_entry(path: Path, table) -> dict:
    """`tokens`: labelled tokens (every label set's; a features shard: positions with states, prompt
    and response), `positions`: response tokens."""
    splits = table.column("split").to_pylist()
    positions = [len(x) for x in table.column("response_ids").to_pylist()]
    if "labels" in table.column_names:
        tokens = [sum(len(labels) for labels in sets) for sets in table.column("labels").to_pylist()]
    else:
        tokens = [len(p) + n if n else 0 for p, n in zip(table.column("prompt_ids").to_pylist(), positions)]
    per_split = {s: {"sequences": sum(1 for x in splits if x == s),
                     "positions": sum(n for x, n in zip(splits, positions) if x == s),
                     "tokens": sum(t for x, t in zip(splits, tokens) if x == s)} for s in SPLITS}
    entry = {"file": path.name, "sha256": sha256_file(path), "rows": table.num_rows, "tokens": sum(tokens),
             "positions": sum(positions), "splits": per_split}
    computed = (table.schema.metadata or {}).get(STATES_COMPUTE.encode())
    if computed is not None:  # (a features shard without it: computed by the target as the engine ran it)
        entry[STATES_COMPUTE] = computed.decode()
    return entry


def model_entry(source: str, role: str, cache_dir: str | None) -> dict:
    """A model's identity without loading its weights."""
    from transformers import AutoConfig

    from specdec.models.sources import model_identity, resolve_model

    model_dir = resolve_model(source, role=role, cache=cache_dir, progress=True)
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (ValueError, OSError) as exc:  # e.g. a feature draft's directory: not a model of its own
        raise ModelSourceError(f"models.{role} {source!r} is not a transformers model: {one_line(exc)}") from None
    return {"source": source, "identity": model_identity(model_dir), "dir": str(model_dir),
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "num_hidden_layers": config.num_hidden_layers}


def settings_of(config: PipelineConfig, draft: dict | None, target: dict) -> dict:
    """What must be equal for shards to belong to one dataset (a features dataset's: no draft, no labels)."""
    data = config.data
    if data.kind == "features":
        return {"format_version": FORMAT_VERSION, "kind": data.kind, "target_identity": target["identity"],
                "prompt_source": data.prompts.source, "validation_fraction": data.prompts.validation_fraction,
                "max_prompt_tokens": data.prompts.max_prompt_tokens, "response": response_settings(data.response),
                "seed": data.seed, "layers": data.features.layers, "states_dtype": "bfloat16"}
    return {"format_version": FORMAT_VERSION, "draft_identity": draft["identity"], "target_identity": target["identity"],
            "prompt_source": data.prompts.source, "validation_fraction": data.prompts.validation_fraction,
            "max_prompt_tokens": data.prompts.max_prompt_tokens,
            "response": response_settings(data.response), "labels": data.labels.model_dump(), "seed": data.seed,
            "draft_format": config.models.draft_format,
            "draft_vocab": vocab_setting(config.models.draft_vocab)}


def head_sequences(items: list, split: str, train: TrainSection) -> list:
    """The sequences of one split (in the dataset's order) the head's data come from: all, or the
    train split's first `train.max_sequences`."""
    return items[:train.max_sequences] if split == "train" and train.max_sequences else items


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise DatasetError(f"no dataset at {directory} (no {MANIFEST_FILE}); run `specdec gen-data` first")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise DatasetError(f"corrupt manifest {path}: {one_line(exc)}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("settings", {}), dict):
        raise DatasetError(f"corrupt manifest {path}: not a manifest's object")
    return manifest


def write_manifest(directory: Path, manifest: dict) -> None:
    write_atomically(directory / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")


def summarise(shards: list[dict]) -> dict:
    counts = {"shards": len(shards), "sequences": sum(s["rows"] for s in shards),
              "positions": sum(s["positions"] for s in shards), "tokens": sum(s["tokens"] for s in shards)}
    for split in SPLITS:
        for key in ("sequences", "positions", "tokens"):
            counts[f"{split}_{key}"] = sum(s["splits"][split][key] for s in shards)
    return counts


# -- the job -------------------------------------------------------------------------------------

def source_prompts(config: PromptsSection) -> tuple[dict[str, list[Prompt]], str]:
    """({source: its prompts in hash order}, the description the manifest records)."""
    from specdec.training import package_prompts as packages
    from specdec.training import prose_prompts as prose
    from specdec.training import stdlib_prompts as stdlib

    loaders = {stdlib.SOURCE_NAME: (stdlib.stdlib_prompts, stdlib.source_description),
               prose.SOURCE_NAME: (prose.prose_prompts, prose.source_description),
               packages.SOURCE_NAME: (packages.package_prompts, packages.source_description)}
    names = _sources(config.source)
    prompts = {name: loaders[name][0](config.validation_fraction) for name in names}
    return prompts, "; ".join(loaders[name][1](len(prompts[name])) for name in names)


def select_prompts(config: DataSection, sources: dict[str, Sequence[Prompt]]) -> list[Prompt]:
    """From each source its first `validation` validation prompts and first `train` train prompts
    (hash order). All validation prompts come first, so a partial run already has held-out data,
    and the sources take turns, so a partial run holds every kind."""
    chosen = []
    for split, limit in (("validation", config.prompts.validation), ("train", config.prompts.train)):
        per_source = [[p for p in prompts if p.split == split][:limit] for prompts in sources.values()]
        chosen += [p for turn in itertools.zip_longest(*per_source) for p in turn if p is not None]
    return chosen


def reusable_responses(directory: str | Path, settings: dict) -> dict[str, Reused]:
    """The responses of the dataset at `directory` (any format), when it was made for the same target,
    response settings, seed and prompt limit as `settings` (a response does not depend on labels or
    on the draft: the engine is lossless; whether references were taken does not matter, they are
    not reused); DatasetError otherwise."""
    directory = Path(directory)
    found = read_manifest(directory).get("settings", {})
    for key in ("target_identity", "response", "seed", "max_prompt_tokens"):
        a, b = found.get(key), settings[key]
        if key == "response" and isinstance(a, dict):
            a, b = {k: v for k, v in a.items() if k != "reference"}, {k: v for k, v in b.items() if k != "reference"}
        if a != b:
            raise DatasetError(f"cannot reuse the responses of {directory}: made with another {key}")
    reused = {}
    for path in shard_paths(directory):
        for row in read_shard(path, columns=("prompt_id", "prompt_ids", "response_ids", "finish_reason")).to_pylist():
            if row["finish_reason"] != FINISH_REFERENCE:  # the target's responses only
                reused[row["prompt_id"]] = Reused(row["prompt_ids"], row["response_ids"], row["finish_reason"])
    return reused


def generate_dataset(config: PipelineConfig, prompts: Sequence[Prompt] | None = None,
                     progress: bool = True, reuse: str | Path | None = None,
                     connect: Callable[[], None] | None = None) -> dict:
    """Generate the missing shards of `config.data.dir` on Ray workers; returns the manifest.

    `prompts` replaces the configured sources (tests); the manifest then names them "custom".
    `reuse`: a dataset whose responses are labelled again instead of regenerated (reusable_responses).
    `connect`: Ray, started once the folder is held and before the models resolve (the CLI's: a wrong
    address, or workers it could never place, fail before a download); None: `ray.init()` where
    there is work to send."""
    import ray
    from ray.util import ActorPool
    from tqdm.auto import tqdm

    from specdec.builder import draft_vocabulary

    data, scaling = config.data, config.scaling
    out = Path(data.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatasetError(f"data.dir {out}: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK | os.X_OK):  # (a read-only file system, no permission)
        raise DatasetError(f"data.dir {out} is not writable")
    # A second gen-data into the folder at once would number its shards as this one's. Held first, as
    # a training holds its run (checkpoints.runs_held): that one is refused before Ray or a model.
    with held(out / LOCK_FILE, DatasetError, f"data.dir {out} is being written", "use another data.dir"):
        if connect is not None:
            checkpoints.connect_ray(connect)
        draft = model_entry(config.models.draft, "draft", config.models.cache_dir)
        target = model_entry(config.models.target, "target", config.models.cache_dir)
        draft_vocabulary(config.models.draft_vocab, Path(draft["dir"]))  # its ids' range, before the workers load
        if draft["vocab_size"] != target["vocab_size"]:  # other padding rows: the engine's check (builder.py)
            from specdec.builder import check_shared_vocabulary, load_tokenizer

            check_shared_vocabulary(Path(draft["dir"]), target["vocab_size"], load_tokenizer(Path(target["dir"])),
                                    draft["source"])
        if data.kind == "features" and max(data.features.layers, default=-1) >= target["num_hidden_layers"]:
            raise IncompatibleModelsError(f"data.features.layers: the target has {target['num_hidden_layers']} "
                                          f"decoder layers (0..{target['num_hidden_layers'] - 1})")
        settings = settings_of(config, draft, target)
        if prompts is None:
            sources, source = source_prompts(data.prompts)
        else:
            sources, source = {"custom": list(prompts)}, "custom prompts (passed in by the caller)"
        selected = select_prompts(data, sources)

        reused = reusable_responses(reuse, settings) if reuse is not None else {}
        if (out / MANIFEST_FILE).is_file() and shard_paths(out):  # (a run that wrote no shard binds nothing)
            _check_same_settings(out, read_manifest(out).get("settings", {}), settings)
        tables = {}
        for path in shard_paths(out):
            try:
                tables[path] = read_shard(path, columns=ENTRY_COLUMNS[data.kind])
            except DatasetError as error:  # cut short (a machine that crashed, a copy cut off): its prompts again
                aside = path.with_name(path.name + ".corrupt")
                os.replace(path, aside)
                logger.warning("%s: moved to %s, its prompts are generated again", error, aside.name)
        shards = [shard_entry(path, table) for path, table in tables.items()]
        done = {pid for table in tables.values() for pid in table.column("prompt_id").to_pylist()}
        # reused responses and references first: each costs one teacher-forced pass, so the dataset grows fastest
        pending = sorted((p for p in selected if p.id not in done),
                         key=lambda p: p.id not in reused and not takes_reference(data.response, p))
        manifest = {"settings": settings, "kind": data.kind, "draft": draft, "target": target, "prompt_source": source,
                    "python": sys.version.split()[0],
                    "prompts_selected": {s: sum(p.split == s for p in selected) for s in SPLITS},
                    "shards": shards, "counts": summarise(shards), "complete": not pending}
        write_manifest(out, manifest)
        if not pending:
            return manifest

        chunks = [pending[i:i + data.shard_size] for i in range(0, len(pending), data.shard_size)]
        if not ray.is_initialized():
            ray.init()
        # A worker that dies (killed, out of memory, a node lost) is restarted and its chunk sent again:
        # rows are written here, by the driver, so a chunk done twice is written once.
        worker = ray.remote(FeatureWriter if data.kind == "features" else ExampleWriter).options(
            num_cpus=scaling.cpus_per_worker, num_gpus=1 if scaling.use_gpu else 0,
            max_restarts=WORKER_RESTARTS, max_task_retries=WORKER_RESTARTS)
        actors = [worker.remote(config.models, data, scaling.threads) for _ in range(min(scaling.num_workers, len(chunks)))]
        pool = ActorPool(actors)
        next_index = max((int(p.name[len(SHARD_PREFIX):-len(SHARD_SUFFIX)]) for p in tables), default=-1) + 1
        bar = tqdm(total=len(selected), initial=len(selected) - len(pending), unit="prompt", desc="gen-data",
                   disable=not progress, file=sys.stderr)
        try:
            def submit(actor, chunk):
                return actor.rows.remote(chunk, {p.id: reused[p.id] for p in chunk if p.id in reused})

            for rows in worker_results(pool.map_unordered(submit, chunks)):
                path = write_shard(out, next_index, rows, data.kind,
                                   data.features.compute if data.kind == "features" else None)
                next_index += 1
                shards.append(shard_entry(path, read_shard(path, columns=ENTRY_COLUMNS[data.kind])))
                manifest["shards"], manifest["counts"] = shards, summarise(shards)
                write_manifest(out, manifest)
                bar.update(len(rows))
                bar.set_postfix(tokens=manifest["counts"]["tokens"])
        finally:
            bar.close()
            for actor in actors:
                ray.kill(actor)
            # ActorPool's queue of chunks not yet submitted: none will run on the killed actors. (Private
            # in Ray 2.60, the pinned version; without it the wait below ends at its first timeout.)
            if (queued := getattr(pool, "_pending_submits", None)) is not None:
                queued.clear()
            # The tasks in flight, refused or failed by the kill: their errors are taken here, which is
            # all they need (else Ray logs each with its traceback as unhandled at exit).
            while pool.has_next():
                try:
                    pool.get_next_unordered(timeout=30)
                except TimeoutError:
                    break
                except Exception:  # noqa: BLE001 - whatever the task ended with, taken
                    continue
        manifest["complete"] = True
        write_manifest(out, manifest)
        return manifest


def worker_results(results: Iterable):
    """`results` of the workers, where a worker's refusal on the config's behalf (a SpecDecError: a
    `data.response.k` past the models' context, a `models.draft_vocab` id past the draft's vocabulary)
    is raised as itself, one line, not as Ray's task error that carries the worker's traceback."""
    from ray.exceptions import RayTaskError

    try:
        yield from results
    except RayTaskError as error:
        if isinstance(error.cause, SpecDecError):
            raise error.cause from None
        raise


def _check_same_settings(directory: Path, found: dict, wanted: dict) -> None:
    found = {**SETTINGS_BEFORE_DRAFT_VOCAB, **found}
    if wanted.get("response", {}).get("reference") and isinstance(found.get("response"), dict):
        # a dataset of the target's responses continues with references: its rows are ones such a run makes
        found["response"] = {**found["response"], "reference": True}
    if set(_sources(found.get("prompt_source"))) < set(_sources(wanted["prompt_source"])):
        # a dataset continues with more sources: each source splits and orders its prompts on its own
        found["prompt_source"] = wanted["prompt_source"]
    for key in wanted:
        if found.get(key) != wanted[key]:
            raise DatasetError(f"{directory} holds data made with other settings ({key} differs); "
                               "use another data.dir or the config that made it")


def _sources(source: str | list[str] | None) -> list[str]:
    return [] if source is None else [source] if isinstance(source, str) else list(source)


# -- reading a dataset for training --------------------------------------------------------------

def load_dataset(directory: str | Path, draft_identity: str | None = None) -> tuple[dict, list[dict]]:
    """(manifest, rows) of every shard the manifest lists, each checked (sha256, non-empty);
    IncompatibleModelsError when the data were made with another draft."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    made_with = manifest.get("settings", {}).get("draft_identity")
    if draft_identity is not None and manifest.get("kind", "labels") != "labels":
        raise DatasetError(f"dataset {directory} holds {manifest['kind']} data, not a model draft's labels: "
                           "data.kind says which (a feature draft's head trains on its features data)")
    if draft_identity is not None and made_with != draft_identity:
        raise IncompatibleModelsError(
            f"dataset {directory} was made with another draft model ({str(made_with)[:12]}), "
            f"not the one being trained ({draft_identity[:12]})")
    if not manifest.get("shards"):
        raise DatasetError(f"dataset {directory} has no shards yet; run `specdec gen-data`")
    rows = []
    for entry in manifest["shards"]:
        path = directory / entry["file"]
        if not path.is_file():
            raise DatasetError(f"shard {path} listed in the manifest is missing")
        rows += read_shard(path, entry.get("sha256")).to_pylist()
    return manifest, rows


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()



def iter_split(rows: Iterable[dict], split: str) -> list[dict]:
    return [r for r in rows if r["split"] == split]
