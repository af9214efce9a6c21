"""The acceptance head's data for a feature draft (models/feature_draft.py), from its features dataset.

A model draft's head learns from label sets that gen-data writes (data.py) and from the draft's
passes over them (train.py). A feature draft reads the target's states, which its features dataset
already holds at every position of prompt + response (the target's output state among them), so
`specdec train-head` on that dataset makes the head's data in one go. Per sequence the draft
unrolls `LABEL_STEPS` draft steps over the stored states (`FeatureDraft.unroll`: step j's state at
position p is the j-th candidate of a round whose target states end at p - j + 1, the candidates
before it the response's own tokens, i.e. accepted), and at each response token and step:

- hidden: the draft's output state there, what `FeatureDraftRuntime` hands the head;
- q: the draft's distribution (its trimmed ids; q = 0 elsewhere); p: the target's, its stored
  output state through its LM head (every id);
- per label set of `data.labels`, Y ~ q and P = min(1, p(Y)/q(Y)) (labels.py; temperature 0: exact
  match), drawn with a generator seeded per prompt;
- scalars: q's features at Y (features.py), the step as the candidate's position in its round.

Worked example: prompt [a b], response [c d e] (T = 5, P = 2): step 1's state at p = 0 drafts c
(from the target's state at a, fed with b); step 2's at p = 1 drafts d from step 1's state at 0,
fed with c. c's p is the target's output state at b, d's at c.

The result has train.py's feature-cache layout, so training, calibration and the saved head are
the model draft's; the head records the feature draft's identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.errors import IncompatibleModelsError
from specdec.features import distribution_features
from specdec.models.feature_draft import FeatureDraft
from specdec.models.feature_files import load_feature_draft, read_config, target_tensors
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.training.config import PipelineConfig
from specdec.training.data import head_sequences, label_distribution
from specdec.training.draft import Example, load_examples, make_batch
from specdec.training.labels import sample_draft_tokens, soft_acceptance_labels_from_logprobs
from specdec.training.mixing import mixing_generator

# Draft steps labelled per position: the rounds the cost-aware rule drafts on this draft's
# acceptance are short (docs/feature-draft.md); a later step's state is judged as step 5's kind.
LABEL_STEPS = 5


def check_feature_head_data(config: PipelineConfig, manifest: dict) -> tuple[str, str]:
    """(the feature draft's directory, its identity) for a head trained on a features dataset: the
    draft this config trains (`draft.output`), made for the target the data were made on."""
    from specdec.models.sources import model_identity

    directory = config.require_draft().output
    draft_config = read_config(directory)
    made_on = manifest.get("settings", {}).get("target_identity")
    if draft_config.target_identity != made_on:
        raise IncompatibleModelsError(f"the feature draft at {directory} reads another target than the one "
                                      f"dataset {config.data.dir} was made on")
    return directory, model_identity(Path(directory))


@torch.inference_mode()
def sequence_features(model: FeatureDraft, target_head: torch.Tensor, example: Example, layers: int,
                      samplings: Sequence[SamplingParams], generator: torch.Generator,
                      steps: int = LABEL_STEPS) -> list[dict[str, torch.Tensor]]:
    """The head's features of one sequence: one dict per label set (train.py's keys: hidden [M, H],
    scalars [M, S], labels, positions (response positions), temperatures [M]; and Y, draft_ids [M]),
    M = its response tokens over every step (module docstring). `target_head` [V, H] is the
    target's LM head.

    q is 0 off the draft's trimmed ids, so everything of q is computed on those (a fifth of the
    vocabulary: the same numbers, a fifth of the work) and P from the two log-probabilities of Y
    (labels.py); p once per position, not per step."""
    batch = make_batch([example], model.config.inputs, layers, model.embed.device)
    outs = model.unroll(batch.states.float(), batch.tokens, steps)  # steps x [1, T, H]
    T, P = len(example.tokens), example.prompt_length
    p_logits = batch.outputs[0, P - 1:T - 1].float() @ target_head.T  # [N, V]: x_P .. x_{T-1}
    hidden, responses, rounds = [], [], []
    for j, out in enumerate(outs, start=1):
        first = max(P - 2, j - 1)  # step j's state at p drafts x_{p+2}, from p >= j - 1
        hidden.append(out[0, first:T - 2])  # [n, H]
        responses.append(torch.arange(first + 2, T) - P)  # [n] response positions
        rounds.append(torch.full((T - 2 - first,), j))
    hidden, responses, rounds = torch.cat(hidden), torch.cat(responses), torch.cat(rounds)
    q_logits = model.logits(hidden).float()  # [M, V_trim]
    out = []
    for sampling in samplings:
        q, p = label_distribution(q_logits, sampling), label_distribution(p_logits, sampling)
        picked = sample_draft_tokens(q, generator)  # [M] trimmed ids
        y = model.vocab_ids[picked]  # [M] the target's ids
        log_p = torch.log(p[responses, y])
        labels = soft_acceptance_labels_from_logprobs(log_p, torch.log(q.gather(-1, picked[:, None])[:, 0]))
        scalars = distribution_features(probs_from_logits(q_logits, sampling), picked, rounds, sampling.greedy)
        out.append({"hidden": hidden, "scalars": scalars, "labels": labels, "draft_ids": y,
                    "positions": responses, "temperatures": torch.full((len(y),), sampling.temperature)})
    return out


def cache_settings(config: PipelineConfig) -> dict:
    """What a feature draft's head features depend on besides the data and the draft (part of the
    feature cache's key: training/train.py `feature_key`)."""
    return {**config.data.labels.model_dump(), "steps": LABEL_STEPS, "max_tokens": config.require_draft().max_tokens}


def feature_draft_features(config: PipelineConfig, data_dir: str, splits: Sequence[str] = ("train", "validation")
                           ) -> tuple[dict[str, list[dict[str, torch.Tensor]]], int]:
    """(per split, the parts of every sequence's features (`sequence_features`); the draft's hidden
    size) for the draft the config trains. A sequence's draws are seeded by its prompt and
    `train.mixing_seed`."""
    from tqdm.auto import tqdm

    from specdec.models.sources import model_identity, resolve_model

    manifest, examples = load_examples(data_dir, config.require_draft().max_tokens, states="lazy")
    target_dir = resolve_model(config.models.target, role="target", cache=config.models.cache_dir)
    model = load_feature_draft(config.draft.output, target_dir, model_identity(target_dir))
    _, target_head = target_tensors(target_dir)
    train = config.require_train()
    layers, samplings, seed = len(manifest["settings"]["layers"]), config.data.labels.sets(), train.mixing_seed
    parts: dict[str, list[dict[str, torch.Tensor]]] = {}
    chosen = [e for split in splits for e in head_sequences(
        [e for e in examples if e.split == split and len(e.tokens) > e.prompt_length], split, train)]
    for e in tqdm(chosen, desc="features", unit="sequence"):
        parts.setdefault(e.split, []).extend(
            sequence_features(model, target_head, e, layers, samplings, mixing_generator(seed, e.prompt_id)))
    return parts, model.layer_config.hidden_size
