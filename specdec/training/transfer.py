"""Does a head trained for one draft judge another draft's candidates as well?

The head reads the draft's hidden state and its distribution at each candidate, so it belongs to the
draft's weights (`HeadConfig.draft_identity`). A draft requantized for faster kernels computes nearly
the same states; the head may serve it (`HeadConfig.validated_drafts`) once, on the validation
responses of its training data, it ranks and calibrates the new draft's candidates as well as its
own draft's, both measured alike:

- the target reads prompt + X teacher-forced once (X: a validation response the target wrote) for
  p_i; each draft reads the same tokens once for q_i and its hidden states;
- per draft, every label set of the row is drawn afresh, Y_i ~ q_i through the set's transform and
  P_i = min(1, p_i(Y_i) / q_i(Y_i)) (data.label_sets), with the same seed per prompt for both;
- the head's calibrated logits on each draft's features (train.pass_features) give AUROC, ECE and
  the mean label, which is the draft's acceptance rate at that temperature.

Accepted (`verdict`) when the new draft's AUROC is at most AUROC_DROP below the reference's and its
ECE at most MAX_ECE: the issue's "AUROC within 0.005, calibration within ECE 0.03".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specdec.head import AcceptanceHead, ValidatedDraft
from specdec.models.runtime import Feed, Runtime
from specdec.sampling import SamplingParams
from specdec.training.data import label_sets, prompt_seed
from specdec.training.evaluation import evaluate_head
from specdec.training.train import pass_features

AUROC_DROP, MAX_ECE = 0.005, 0.03


@torch.inference_mode()
def teacher_forced(runtime: Runtime, prompt_ids: list[int], response_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, V] fp32, hidden [N, H]) at the N response positions, from one pass of a fresh
    session over prompt + X_<N: row i is the model's state before X_{i+1} (data.response_logits)."""
    feed = Feed(runtime.new_session(), list(prompt_ids) + list(response_ids[:-1]), len(response_ids))
    logits, hidden = runtime._forward([feed])[0]  # on the runtime's device; the labels are drawn on the host
    return logits.float().cpu(), hidden.cpu()


@dataclass
class _Tokens:
    logits: list[torch.Tensor]  # [M] the head's calibrated logits, per row and label set
    labels: list[torch.Tensor]  # [M] P_i
    temperatures: list[torch.Tensor]  # [M]


def compare_drafts(head: AcceptanceHead, target: Runtime, drafts: dict[str, Runtime], rows: Iterable[dict],
                   samplings_of, mixing_ratio: float, mixing_seed: int, label_seed: int) -> dict[str, dict]:
    """Per draft name: {"all": metrics, "T=<t>": metrics per label temperature}, each metrics
    {count, mean_label, mean_prediction, kl, auroc, ece} over the rows' response positions.
    `samplings_of(row) -> list[SamplingParams]`: the transform of each of the row's label sets."""
    seen = {name: _Tokens([], [], []) for name in drafts}
    for row in rows:
        prompt_ids, response_ids = row["prompt_ids"], row["response_ids"]
        p_logits, _ = teacher_forced(target, prompt_ids, response_ids)
        samplings: list[SamplingParams] = samplings_of(row)
        for name, draft in drafts.items():
            q_logits, hidden = teacher_forced(draft, prompt_ids, response_ids)
            sets = label_sets(q_logits, p_logits, samplings,
                              torch.Generator().manual_seed(prompt_seed(label_seed, row["prompt_id"])))
            features = pass_features(hidden, q_logits, row, mixing_ratio, mixing_seed, samplings,
                                     [s.draft_ids for s in sets], [s.labels for s in sets])
            for part in features:
                inputs = head.head_inputs(part["hidden"].float(), part["scalars"])
                with torch.inference_mode():
                    seen[name].logits.append(head.calibrated_logits(inputs).float())
                seen[name].labels.append(part["labels"])
                seen[name].temperatures.append(part["temperatures"])
    return {name: _metrics(tokens) for name, tokens in seen.items()}


def _metrics(tokens: _Tokens) -> dict[str, dict]:
    logits, labels = torch.cat(tokens.logits), torch.cat(tokens.labels)
    temperatures = torch.cat(tokens.temperatures)
    out = {"all": evaluate_head(logits, labels).scalars()}
    for t in sorted(set(temperatures.tolist())):
        chosen = temperatures == t
        out[f"T={t:g}"] = evaluate_head(logits[chosen], labels[chosen]).scalars()
    return out


def verdict(reference: dict, candidate: dict) -> bool:
    """The head serves the candidate draft: AUROC at most AUROC_DROP below the reference's, ECE at
    most MAX_ECE (both over all label sets)."""
    return candidate["auroc"] >= reference["auroc"] - AUROC_DROP and candidate["ece"] <= MAX_ECE


def validated_draft(identity: str, name: str, reference: dict, candidate: dict, source: str = "") -> ValidatedDraft:
    """The record `HeadConfig.validated_drafts` keeps for an accepted draft."""
    return ValidatedDraft(identity=identity, name=name, tokens=candidate["count"], auroc=candidate["auroc"],
                          ece=candidate["ece"], reference_auroc=reference["auroc"], reference_ece=reference["ece"],
                          source=source)
