"""Replay stopping rules offline on the head's validation tokens: what each rule would gain with the
shipped head and a cost profile, in seconds instead of hours of `specdec bench`.

    python -m benchmarks.replay_rules                       # the default pair's feature cache and head
    python -m benchmarks.replay_rules --features ~/.cache/specdec/training/default-pair/features/<key>.pt
    python -m benchmarks.replay_rules --config cluster/training/default-pair.yaml   # no cache yet: make the
        # validation split's (the draft's passes over the validation responses; ~/.cache/specdec/replay/)

The feature cache (`specdec train-head` writes it, training/train.py `compute_features`) holds, for
every validation response X of the target and every label set, the draft's features at each
position (the state q_i came from and q_i's scalars at y_i) and the label. Greedy, the loop's rounds
are a function of those alone: a round from committed position t drafts the draft's argmax along
X, the candidates are accepted up to the first label 0, and t moves by the accepted run + 1. So a
rule's tokens per second under the profile's costs (drafting steps x t_draft + t_target(k) a round)
follow exactly, except in two places: past the first rejected candidate the replay shows the rule
the teacher-forced features rather than those of the draft's own wrong continuation, and the
abstention backoff of `specdec++cost` is left out. At T = 1 a candidate is accepted with its soft
label's probability (one draw per candidate, seeded), from the label sets' draws of y_i.

A feature draft's cache (training/feature_labels.py, `label_steps` in the cache) holds each response
position once per draft step, because its state differs by step: the i-th candidate of a round is
read from step i's row (the last step's for later ones, with its position feature), its label too.

The rules read the scalar features (the cache keeps no full q): confidence stops after a candidate
whose top-1 probability is below tau, svip once sqrt(0.15 H(q_i)) > tau, specdec++:h once the
head's 1 - prod a_j > h; specdec++cost spends the step's budget (specdec/budget.py) over the step's
sessions.

`bound:lam` is no rule the loop could run: it sees the head's a_j of every candidate ahead before
drafting any (along X) and drafts the k maximising E[tokens](k) - lam * cost(k), with E[tokens](k)
= 1 + sum_{m<=k} prod_{j<=m} a_j. Swept over lam (tokens per ms, the rate it trades against), its
best is an upper bound on what any stopping rule reading this head's probabilities can reach.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.cost_profile import DEFAULT_PROFILE, CostProfile
from specdec.head import load_head
from specdec.budget import drafting_pays, replay_step
from specdec.policies.svip import SVIP

HEAD = Path(__file__).resolve().parents[1] / "specdec" / "heads" / "default-pair"
CACHE = Path("~/.cache/specdec/training/default-pair/features").expanduser()
REPLAY_CACHE = Path("~/.cache/specdec/replay").expanduser()
MAX_K = 20
LOG_TOP1, ENTROPY, LOG_POSITION = 1, 3, 4  # scalar feature columns (specdec/features.py)

# a session's round: (acceptance [n, MAX_K] by round position, scalars [n, MAX_K, S], t, n)
Round = tuple[torch.Tensor, torch.Tensor, int, int]
# a rule: a step's rounds -> (candidates kept, draft steps) each; all but specdec++cost decide each
# session's round alone (`each`), specdec++cost spends one budget over the step's sessions
Rule = Callable[[list[Round]], list[tuple[int, int]]]


def each(rule: Callable[[torch.Tensor, torch.Tensor, int, int], tuple[int, int]]) -> Rule:
    return lambda rounds: [rule(*r) for r in rounds]


def stop_after(test: Callable[[int, int], bool]) -> Callable[[int, int], tuple[int, int]]:
    """A rule that keeps every candidate it drafts and stops after the first i where test(t + i - 1, i)."""
    def rule(t: int, n: int) -> tuple[int, int]:
        k = 0
        while k < min(MAX_K, n - t):
            k += 1
            if test(t + k - 1, k):
                break
        return k, k
    return rule


def rules(head, profile: CostProfile) -> dict[str, Rule]:
    out: dict[str, Rule] = {}
    for k in (1, 2, 3, 4, 6, 8, 10):
        out[f"fixed:{k}"] = each(lambda acc, sc, t, n, k=k: (min(k, n - t), min(k, n - t)))
    for tau in (0.4, 0.6, 0.7, 0.8, 0.9):
        out[f"confidence:{tau}"] = each(lambda acc, sc, t, n, tau=tau: stop_after(
            lambda j, i: math.exp(float(sc[j, i - 1, LOG_TOP1])) < tau)(t, n))
    for tau in (0.2, 0.3, 0.4):
        out[f"svip:{tau}"] = each(lambda acc, sc, t, n, tau=tau: stop_after(
            lambda j, i: math.sqrt(SVIP.DEFAULT_GAMMA * max(0.0, float(sc[j, i - 1, ENTROPY]))) > tau)(t, n))
    for h in (0.3, 0.5, 0.7, 0.9):
        out[f"specdec++:{h}"] = each(lambda acc, sc, t, n, h=h: specdec_pp(acc, t, n, h))
    out["specdec++cost"] = lambda rounds: specdec_pp_cost(profile, rounds)
    costs = [k * profile.t_draft_ms + profile.t_target(k) for k in range(MAX_K + 1)]
    for lam in (0.003, 0.004, 0.005, 0.006, 0.008):
        out[f"bound:{lam}"] = each(lambda acc, sc, t, n, lam=lam: lookahead_bound(acc, t, n, lam, costs))
    return out


def specdec_pp(acc: torch.Tensor, t: int, n: int, h: float) -> tuple[int, int]:
    last, survive = min(MAX_K, n - t), 1.0
    for i in range(1, last + 1):
        survive *= float(acc[t + i - 1, i - 1])
        if 1.0 - survive > h:
            return i, i
    return last, last


def specdec_pp_cost(profile: CostProfile, rounds: list[Round]) -> list[tuple[int, int]]:
    """The step's rounds as one budget spends them (specdec/budget.py `replay_step`), none where no
    round would pay even if every candidate were accepted (the planner keeps the draft off; its
    further choice of who drafts, for sessions whose drafts lag, does not arise in a replay)."""
    if not drafting_pays(profile, len(rounds), MAX_K):
        return [(0, 0)] * len(rounds)
    limits = [min(MAX_K, n - t) for _, _, t, n in rounds]
    return replay_step(profile, [[float(acc[t + i, i]) for i in range(limit)]
                                 for (acc, _, t, _), limit in zip(rounds, limits)], limits)


def lookahead_bound(acc: torch.Tensor, t: int, n: int, lam: float, costs: list[float]) -> tuple[int, int]:
    best, best_k, survive, expected = -math.inf, 0, 1.0, 1.0
    for k in range(min(MAX_K, n - t) + 1):
        if k:
            survive *= float(acc[t + k - 1, k - 1])
            expected += survive
        if expected - lam * costs[k] > best:
            best, best_k = expected - lam * costs[k], k
    return best_k, best_k


def newest_cache() -> Path:
    """The newest feature cache of the default pair's head training; exits in one line without one."""
    caches = list(CACHE.glob("*.pt"))
    if not caches:
        raise SystemExit(f"no feature cache in {CACHE}: `specdec train-head --config "
                         "cluster/training/default-pair.yaml` makes it (benchmarks.replay_rules also takes "
                         "--config or --features)")
    return max(caches, key=lambda p: p.stat().st_mtime)


def label_sets(features: dict) -> list[tuple[int, int]]:
    """[start, end) of every label set of a feature split, in order (positions restart at 0)."""
    starts = (features["positions"] == 0).nonzero().flatten().tolist() + [len(features["positions"])]
    return list(zip(starts, starts[1:]))


def responses(features: dict, temperature: float) -> list[tuple[int, int]]:
    """[start, end) of every validation label set at `temperature`."""
    return [(a, b) for a, b in label_sets(features) if float(features["temperatures"][a]) == temperature]


@torch.inference_mode()
def acceptance_by_position(head, features: dict, a: int, b: int) -> torch.Tensor:
    """[n, MAX_K]: the head's a(y_j) were y_j the i-th candidate of its round (the position feature)."""
    hidden, scalars = features["hidden"][a:b].float(), features["scalars"][a:b]
    columns = []
    for i in range(1, MAX_K + 1):
        s = scalars.clone()
        s[:, LOG_POSITION] = math.log(i)
        columns.append(head.acceptance_probability(head.head_inputs(hidden, s)).double())
    return torch.stack(columns, dim=1)


@torch.inference_mode()
def step_tables(head, features: dict, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A feature draft's response (rows [a, b): step 1's positions, then step 2's, ...) -> (acceptance,
    labels [n, MAX_K], scalars [n, MAX_K, S]): candidate i at position r is step i's row at r (the
    last step's past it, its position feature set to i); a row the cache lacks is a rejection."""
    positions, scalars = features["positions"][a:b], features["scalars"][a:b].clone()
    steps = torch.exp(scalars[:, LOG_POSITION]).round().long()  # [m] 1..label_steps
    n, last = int(positions.max()) + 1, int(steps.max())
    acc, labels = torch.zeros(n, MAX_K, dtype=torch.float64), torch.zeros(n, MAX_K)
    table = torch.zeros(n, MAX_K, scalars.shape[-1])
    for i in range(1, MAX_K + 1):
        rows = (steps == min(i, last)).nonzero().flatten()
        s = scalars[rows].clone()
        s[:, LOG_POSITION] = math.log(i)
        r = positions[rows]
        acc[r, i - 1] = head.acceptance_probability(head.head_inputs(features["hidden"][a:b][rows].float(), s)).double()
        labels[r, i - 1], table[r, i - 1] = features["labels"][a:b][rows], s
    return acc, labels, table


def tables_of(head, features: dict, temperature: float, label_steps: int | None = None
              ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(acceptance, labels [n, MAX_K], scalars [n, MAX_K, S]) of every validation response at
    `temperature`, by round position: a model draft's rows hold every round position at once; a
    feature draft's cache (`label_steps` set) one block of rows per step."""
    if label_steps:
        step, positions = torch.exp(features["scalars"][:, LOG_POSITION]).round(), features["positions"]
        temperatures = features["temperatures"]
        starts = [j for j in range(len(step)) if step[j] == 1 and (j == 0 or step[j - 1] != 1
                                                                  or positions[j] <= positions[j - 1])] + [len(step)]
        return [step_tables(head, features, a, b) for a, b in zip(starts, starts[1:])
                if float(temperatures[a]) == temperature]
    out = []
    for a, b in responses(features, temperature):
        scalars = features["scalars"][a:b]
        out.append((acceptance_by_position(head, features, a, b), features["labels"][a:b, None].expand(-1, MAX_K),
                    scalars[:, None].expand(-1, MAX_K, -1)))
    return out


def replay(rule: Rule, tables, profile: CostProfile, sampled: bool, sessions: int = 1,
           host_ms: float = 0.0) -> tuple[float, float]:
    """-> (tokens per second, drafting steps per token) of `rule` over the responses' tables.

    `sessions` > 1: that many sessions decode in lock-step (continuous batching: a session that
    finishes takes the next response, the responses cycled so that three batches' worth follow the
    first) and the replay stops when a slot finds none left, so every step counted is a full batch.
    A step costs its drafting steps (each at `profile.draft_ms` of the sessions still drafting),
    one verification pass over every session's round (`profile.pass_ms` of the tokens it feeds) and
    `host_ms` (the loop's own work a step, measured apart)."""
    generator = torch.Generator().manual_seed(0)
    repeats = 1 if sessions == 1 else math.ceil(4 * sessions / len(tables))  # >= 3 batches queued after the first
    queue = iter([i for _ in range(repeats) for i in range(len(tables))])
    slots = [[i, 0] for i in itertools.islice(queue, sessions)]  # [response, committed position]
    tokens = ms = steps_total = 0.0
    while slots:
        rounds = rule([(tables[i][0], tables[i][2], t, len(tables[i][0])) for i, t in slots])
        drafting = max(steps for _, steps in rounds)
        ms += sum(profile.draft_ms(sum(steps >= i for _, steps in rounds)) for i in range(1, drafting + 1))
        ms += profile.pass_ms(sum(k + 1 for k, _ in rounds)) + host_ms
        steps_total += drafting
        finished = []
        for slot, (k, _) in zip(slots, rounds):
            t, (acc, labels, _) = slot[1], tables[slot[0]]
            n, accepted = len(acc), 0
            for m, j in enumerate(range(t, t + k)):
                p = float(labels[j, m])
                if not (torch.rand(1, generator=generator).item() < p if sampled else p >= 0.5):
                    break
                accepted += 1
            tokens += min(accepted + 1, n - t)
            slot[1] = t + accepted + 1
            if slot[1] >= n:
                following = next(queue, None)
                if following is None:
                    finished.append(slot)
                else:
                    slot[:] = [following, 0]
        # one session runs through the responses; a batch stops before it would shrink (steady state)
        slots = [] if finished and sessions > 1 else [s for s in slots if all(s is not f for f in finished)]
    return tokens / ms * 1000.0, steps_total / tokens


def validation_cache(config_path: Path) -> Path:
    """The feature cache of a training config's validation split alone (training/train.py's layout),
    made once under ~/.cache/specdec/replay: what a replay reads, without training a head."""
    from specdec.training.config import load_config
    from specdec.training.train import check_dataset, compute_features, feature_key

    config = load_config(config_path)
    manifest, identity, _ = check_dataset(config)
    out = REPLAY_CACHE / f"{feature_key(manifest, config.require_train(), identity)}-validation.pt"
    if not out.is_file():
        compute_features(config, str(Path(config.data.dir).resolve()), str(out), identity, splits=("validation",))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", type=Path, help="a feature cache (default: the newest in " + str(CACHE) + ")")
    parser.add_argument("--head", type=Path, default=HEAD)
    parser.add_argument("--profile", type=Path, help="a cost profile JSON (default: the torch runtime's)")
    parser.add_argument("--config", type=Path, help="a training config: replay its validation split's features, "
                                                    "made here first if no cache of them exists")
    args = parser.parse_args()
    path = args.features or (validation_cache(args.config) if args.config else newest_cache())
    cache = torch.load(path, weights_only=True)
    features = cache["validation"]
    head = load_head(args.head)
    profile = CostProfile.load(args.profile) if args.profile else DEFAULT_PROFILE
    print(f"features {path.name}, head {args.head}, profile: {profile.source}\n")
    print("| rule | greedy tok/s | steps/token | T=1 tok/s | steps/token |\n|---|---|---|---|---|")
    tables = {T: tables_of(head, features, T, cache.get("label_steps")) for T in (0.0, 1.0)}
    for name, rule in rules(head, profile).items():
        greedy = replay(rule, tables[0.0], profile, sampled=False)
        sampled = replay(rule, tables[1.0], profile, sampled=True)
        print(f"| {name} | {greedy[0]:.3f} | {greedy[1]:.2f} | {sampled[0]:.3f} | {sampled[1]:.2f} |")
    print(f"\n{len(tables[0.0])} greedy responses, {len(tables[1.0])} T=1 label sets")


if __name__ == "__main__":
    main()
