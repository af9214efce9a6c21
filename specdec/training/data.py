"""Training data for the acceptance head (paper §3.3), generated on Ray workers, resumable.

For every prompt (specdec.training.stdlib_prompts; never HumanEval):

1. the target's response X_1..X_N, written by the project's lossless engine (its output follows
   the target's distribution exactly, and it is faster than the target alone);
2. p_i at every position: the target's logits from the verification passes that wrote X (every
   committed token is a row of some pass, scored after exactly X_<i: `RecordingTarget`), so the
   target never runs twice; q_i: one teacher-forced pass of the draft over prompt + X;
3. one Y_i ~ q_i per position and the soft label P_i = min(1, p_i(Y_i) / q_i(Y_i)) (labels.py),
   p and q through the `labels` sampling transform (temperature 0: one-hot argmax, exact match).

Layout of `data.dir`:

    manifest.json          models (identities), settings, prompt source, shards with sha256, counts
    shard-00000.parquet    one row per prompt: prompt_id, split, prompt_ids, response_ids (X),
    shard-00001.parquet    draft_ids (Y), labels (P), finish_reason, seed
    ...

Shards hold token ids and labels only (a few bytes per token); the draft's hidden states are
computed at training time (train.py), because they depend on the mixing draw and are ~1000x larger.

Resume: a shard is written to a temporary name and renamed, so a shard on disk is complete; a
rerun reads the prompt ids of every shard, skips those prompts, and rebuilds the manifest from the
shards on disk. A rerun with other models or settings into the same directory is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import IncompatibleModelsError, SpecDecError
from specdec.models.vocab import SETTINGS_BEFORE_DRAFT_VOCAB, vocab_setting
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.training.config import DataSection, ModelsSection, PipelineConfig
from specdec.training.labels import sample_draft_tokens, soft_acceptance_labels
from specdec.training.stdlib_prompts import Prompt, source_description, stdlib_prompts

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SHARD_PREFIX, SHARD_SUFFIX = "shard-", ".parquet"
SPLITS = ("train", "validation")
SHARD_COLUMNS = ("prompt_id", "split", "prompt_ids", "response_ids", "draft_ids", "labels", "finish_reason", "seed")
SEED_BITS = 63
FINISH_TOO_LONG = "prompt_too_long"  # a row with no response: over max_prompt_tokens or the models' context


class DatasetError(SpecDecError):
    """A data directory that cannot be used: missing or foreign manifest, empty or corrupt shard."""


@dataclass(frozen=True)
class LabelledResponse:
    response_ids: list[int]  # X_1..X_N
    draft_ids: list[int]  # Y_1..Y_N, Y_i ~ q(. | prompt, X_<i)
    labels: list[float]  # P_i = min(1, p_i(Y_i) / q_i(Y_i))


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
                   sampling: SamplingParams, generator: torch.Generator,
                   target_logits: torch.Tensor | None = None) -> LabelledResponse:
    """`target_logits` [N, V]: the target's logits at the response positions when already known
    (recorded during generation); otherwise a teacher-forced pass of `target_model` computes them."""
    q = label_distribution(response_logits(draft_model, prompt_ids, response_ids), sampling)  # [N, V]
    if target_logits is None:
        target_logits = response_logits(target_model, prompt_ids, response_ids)
    p = label_distribution(target_logits.float(), sampling)  # [N, V]
    y = sample_draft_tokens(q.cpu(), generator)  # [N]
    labels = soft_acceptance_labels(p.cpu(), q.cpu(), y)  # [N]
    return LabelledResponse(list(response_ids), y.tolist(), labels.tolist())


class RecordingTarget:
    """A TargetRuntime that keeps every verification pass's logits, keyed by the history length it
    scored after, so the logits of the committed response can be read back (`committed_logits`).
    For one sequence at a time."""

    def __init__(self, target):
        self.target, self.calls = target, []  # calls: [(len(history), logits [K+1, V])]

    def __getattr__(self, name: str):
        return getattr(self.target, name)

    def score(self, sessions: list, histories: list[list[int]], candidates: list[list[int]]) -> list[torch.Tensor]:
        rows = self.target.score(sessions, histories, candidates)
        self.calls.extend((len(history), logits) for history, logits in zip(histories, rows))
        return rows

    def committed_logits(self, prompt_len: int, num_tokens: int) -> torch.Tensor:
        """[N, V]: row i is the target's logits for response token X_{i+1}, i.e. after prompt + X_1..X_i.

        Worked example: prompt of 5 tokens; round 1 scored after h=5 with rows for positions 5..8 and
        committed 3 tokens (absolute 5, 6, 7); round 2 scored after h=8. Position 7 comes from round 1
        row 2; position 8 from round 2 row 0: the last pass with h <= position is the one that
        committed it (every pass starts right after the committed history)."""
        rows = []
        for position in range(prompt_len, prompt_len + num_tokens):
            start, logits = next((h, x) for h, x in reversed(self.calls) if h <= position)
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
        self.data = data
        self.engine = build_engine(models.engine_config(threads), progress=False)
        self.target = self.engine.verifier_worker.target = RecordingTarget(self.engine.target)

    def rows(self, prompts: Sequence[Prompt]) -> list[dict]:
        from specdec.params import GenerationParams

        response, rows = self.data.response, []
        for prompt in prompts:
            seed = prompt_seed(self.data.seed, prompt.id)
            prompt_ids = self.engine.encode_prompt(prompt.text)
            row = {"prompt_id": prompt.id, "split": prompt.split, "prompt_ids": prompt_ids, "response_ids": [],
                   "draft_ids": [], "labels": [], "finish_reason": FINISH_TOO_LONG, "seed": seed}
            limit = min(self.data.prompts.max_prompt_tokens, self.engine.max_context - 1)
            if len(prompt_ids) > limit:  # kept as a row without a response: resume skips it
                rows.append(row)
                continue
            params = GenerationParams(max_new_tokens=response.max_new_tokens, sampling=response.sampling(seed),
                                      policy=response.policy_config())
            self.target.calls.clear()
            completion = self.engine.generate_ids(prompt_ids, params).completions[0]
            row["finish_reason"] = completion.finish_reason
            if completion.token_ids:
                target_logits = self.target.committed_logits(len(prompt_ids), len(completion.token_ids))
                self.target.calls.clear()
                labelled = label_response(self.engine.draft.model, self.target.model, prompt_ids,
                                          completion.token_ids, self.data.labels.sampling(),
                                          torch.Generator().manual_seed(seed), target_logits)
                row.update(response_ids=labelled.response_ids, draft_ids=labelled.draft_ids, labels=labelled.labels)
            rows.append(row)
        return rows


# -- shards and the manifest ---------------------------------------------------------------------

def shard_schema():
    import pyarrow as pa

    return pa.schema([("prompt_id", pa.string()), ("split", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                      ("response_ids", pa.list_(pa.int32())), ("draft_ids", pa.list_(pa.int32())),
                      ("labels", pa.list_(pa.float32())), ("finish_reason", pa.string()), ("seed", pa.int64())])


def write_shard(directory: Path, index: int, rows: list[dict]) -> Path:
    """Write rows as shard `index`, atomically (temporary name, then rename)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = directory / f"{SHARD_PREFIX}{index:05d}{SHARD_SUFFIX}"
    partial = path.with_name(path.name + ".partial")
    pq.write_table(pa.Table.from_pylist(rows, schema=shard_schema()), partial)
    os.replace(partial, path)
    return path


def shard_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}"))


def read_shard(path: Path, expected_sha256: str | None = None):
    """The shard's table; DatasetError (one line) when it is empty, corrupt or not a shard."""
    import pyarrow.parquet as pq

    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise DatasetError(f"shard {path} is corrupt: its sha256 differs from the manifest's")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DatasetError(f"shard {path} is corrupt or not parquet: {_first_line(exc)}") from None
    missing = [c for c in SHARD_COLUMNS if c not in table.column_names]
    if missing:
        raise DatasetError(f"shard {path} is not a training shard (missing columns: {', '.join(missing)})")
    if table.num_rows == 0:
        raise DatasetError(f"shard {path} is empty")
    return table


def shard_entry(path: Path, table) -> dict:
    splits = table.column("split").to_pylist()
    tokens = [len(x) for x in table.column("labels").to_pylist()]
    per_split = {s: {"sequences": sum(1 for x in splits if x == s),
                     "tokens": sum(t for x, t in zip(splits, tokens) if x == s)} for s in SPLITS}
    return {"file": path.name, "sha256": sha256_file(path), "rows": table.num_rows, "tokens": sum(tokens),
            "splits": per_split}


def model_entry(source: str, role: str, cache_dir: str | None) -> dict:
    """A model's identity without loading its weights."""
    from transformers import AutoConfig

    from specdec.models.sources import model_identity, resolve_model

    model_dir = resolve_model(source, role=role, cache=cache_dir, progress=True)
    config = AutoConfig.from_pretrained(model_dir)
    return {"source": source, "identity": model_identity(model_dir), "dir": str(model_dir),
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}


def settings_of(config: PipelineConfig, draft: dict, target: dict) -> dict:
    """What must be equal for shards to belong to one dataset."""
    data = config.data
    return {"format_version": FORMAT_VERSION, "draft_identity": draft["identity"], "target_identity": target["identity"],
            "prompt_source": data.prompts.source, "validation_fraction": data.prompts.validation_fraction,
            "max_prompt_tokens": data.prompts.max_prompt_tokens,
            "response": data.response.model_dump(), "labels": data.labels.model_dump(), "seed": data.seed,
            "draft_vocab": vocab_setting(config.models.draft_vocab)}


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise DatasetError(f"no dataset at {directory} (no {MANIFEST_FILE}); run `specdec gen-data` first")
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise DatasetError(f"corrupt manifest {path}: {_first_line(exc)}") from None


def write_manifest(directory: Path, manifest: dict) -> None:
    path = directory / MANIFEST_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, path)


def summarise(shards: list[dict]) -> dict:
    counts = {"shards": len(shards), "sequences": sum(s["rows"] for s in shards),
              "tokens": sum(s["tokens"] for s in shards)}
    for split in SPLITS:
        counts[f"{split}_sequences"] = sum(s["splits"][split]["sequences"] for s in shards)
        counts[f"{split}_tokens"] = sum(s["splits"][split]["tokens"] for s in shards)
    return counts


# -- the job -------------------------------------------------------------------------------------

def select_prompts(config: DataSection, prompts: Sequence[Prompt]) -> list[Prompt]:
    """The first `validation` validation prompts, then the first `train` train prompts (hash order):
    validation first, so a partial run already has held-out data."""
    chosen = []
    for split, limit in (("validation", config.prompts.validation), ("train", config.prompts.train)):
        chosen += [p for p in prompts if p.split == split][:limit]
    return chosen


def generate_dataset(config: PipelineConfig, prompts: Sequence[Prompt] | None = None,
                     progress: bool = True) -> dict:
    """Generate the missing shards of `config.data.dir` on Ray workers; returns the manifest.

    `prompts` replaces the stdlib prompts (tests); the manifest then names them "custom"."""
    import ray
    from ray.util import ActorPool
    from tqdm.auto import tqdm

    data, scaling = config.data, config.scaling
    out = Path(data.dir)
    draft = model_entry(config.models.draft, "draft", config.models.cache_dir)
    target = model_entry(config.models.target, "target", config.models.cache_dir)
    if draft["vocab_size"] != target["vocab_size"]:
        raise IncompatibleModelsError(f"draft and target vocabularies differ ({draft['vocab_size']} vs "
                                      f"{target['vocab_size']} tokens)")
    settings = settings_of(config, draft, target)
    source = "custom prompts (passed in by the caller)" if prompts is not None else None
    if prompts is None:
        prompts = stdlib_prompts(data.prompts.validation_fraction)
        source = source_description(len(prompts))
    selected = select_prompts(data, prompts)

    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST_FILE).is_file():
        _check_same_settings(out, read_manifest(out).get("settings", {}), settings)
    shards = [shard_entry(path, read_shard(path)) for path in shard_paths(out)]
    done = {pid for path in shard_paths(out) for pid in read_shard(path).column("prompt_id").to_pylist()}
    pending = [p for p in selected if p.id not in done]
    manifest = {"settings": settings, "draft": draft, "target": target, "prompt_source": source,
                "python": sys.version.split()[0],
                "prompts_selected": {s: sum(p.split == s for p in selected) for s in SPLITS},
                "shards": shards, "counts": summarise(shards), "complete": not pending}
    write_manifest(out, manifest)
    if not pending:
        return manifest

    chunks = [pending[i:i + data.shard_size] for i in range(0, len(pending), data.shard_size)]
    if not ray.is_initialized():
        ray.init()
    worker = ray.remote(ExampleWriter).options(num_cpus=scaling.cpus_per_worker,
                                               num_gpus=1 if scaling.use_gpu else 0)
    actors = [worker.remote(config.models, data, scaling.threads) for _ in range(min(scaling.num_workers, len(chunks)))]
    pool = ActorPool(actors)
    next_index = max((int(p.name[len(SHARD_PREFIX):-len(SHARD_SUFFIX)]) for p in shard_paths(out)), default=-1) + 1
    bar = tqdm(total=len(selected), initial=len(selected) - len(pending), unit="prompt", desc="gen-data",
               disable=not progress, file=sys.stderr)
    try:
        for rows in pool.map_unordered(lambda actor, chunk: actor.rows.remote(chunk), chunks):
            path = write_shard(out, next_index, rows)
            next_index += 1
            shards.append(shard_entry(path, read_shard(path)))
            manifest["shards"], manifest["counts"] = shards, summarise(shards)
            write_manifest(out, manifest)
            bar.update(len(rows))
            bar.set_postfix(tokens=manifest["counts"]["tokens"])
    finally:
        bar.close()
        for actor in actors:
            ray.kill(actor)
    manifest["complete"] = True
    write_manifest(out, manifest)
    return manifest


def _check_same_settings(directory: Path, found: dict, wanted: dict) -> None:
    found = {**SETTINGS_BEFORE_DRAFT_VOCAB, **found}
    for key in wanted:
        if found.get(key) != wanted[key]:
            raise DatasetError(f"{directory} holds data made with other settings ({key} differs); "
                               "use another data.dir or the config that made it")


# -- reading a dataset for training --------------------------------------------------------------

def load_dataset(directory: str | Path, draft_identity: str | None = None) -> tuple[dict, list[dict]]:
    """(manifest, rows) of every shard the manifest lists, each checked (sha256, non-empty);
    IncompatibleModelsError when the data were made with another draft."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    made_with = manifest.get("settings", {}).get("draft_identity")
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


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def iter_split(rows: Iterable[dict], split: str) -> list[dict]:
    return [r for r in rows if r["split"] == split]
