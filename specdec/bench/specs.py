"""Policy specs: the strings `specdec bench --policies` takes, one per operating point.

    target-only            the baseline speedups are measured against
    fixed:4                fixed K = 4 (bare `fixed`: the policy's default K)
    heuristic[:K]          HF's heuristic schedule in our loop, initial K
    svip:0.5               SVIP at entropy threshold 0.5
    confidence:0.4         HF's confidence rule in our loop, at probability threshold 0.4
    specdec++:0.3          SpecDec++ at stopping threshold h = 0.3 (needs an acceptance head)
    specdec++cost          cost-aware SpecDec++: stops by the cost profile (needs a head; no value)
    oracle                 the greedy hindsight oracle (the limit; greedy only)
    hf-heuristic[:K]       the peer: HF `generate(assistant_model=...)`, heuristic schedule, initial K
    hf-dynamic[:T]         the peer: HF's dynamic default, confidence threshold T, at most 20 tokens
    llamacpp-lookup[:N]    llama-cpp-python's prompt lookup decoding on the target's GGUF, N tokens a
                           step (default 2, its CPU setting): the suffix draft's peer
    specdec++cost@feature  any of ours on the engine's draft named `feature` (`--also-draft
                           feature=SRC`): drafts side by side in one run, interleaved prompt by prompt

A spec's canonical form (`fixed:4`, `svip:0.5`, `hf-dynamic`, `fixed:2@feature`) keys its records,
so `svip:0.50` and `svip:0.5` are the same operating point.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import InvalidRequestError
from specdec.params import DEFAULT_DRAFT
from specdec.policies import POLICY_NAMES, PolicyConfig
from specdec.policies.base import check_count, check_threshold

BASELINE = "target-only"  # plain decoding: what every speedup divides by
HF_PEERS = ("hf-heuristic", "hf-dynamic")
LOOKUP_PEER = "llamacpp-lookup"  # llama-cpp-python's prompt lookup decoding on the target's GGUF
PEER_NAMES = (*HF_PEERS, LOOKUP_PEER)
K_NAMES = ("fixed", "heuristic", "hf-heuristic", LOOKUP_PEER)  # whose value is an integer K; the others take a threshold
NO_VALUE_NAMES = ("target-only", "oracle", "specdec++cost")
SWEPT_FAMILIES = ("fixed", "specdec++", "svip", "confidence")  # families drawn as a frontier

# The sweep: the paper's K in {2..14}, h in {0.1..0.9}; small sweeps for the training-free
# rules around their official defaults (SVIP 0.3, HF confidence 0.4).
FIXED_KS = (2, 4, 6, 8, 10, 12, 14)
SPECDEC_PP_THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)
SVIP_THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6)
CONFIDENCE_THRESHOLDS = (0.2, 0.4, 0.6, 0.8)
DEFAULT_POLICIES = (
    "target-only",
    *(f"fixed:{k}" for k in FIXED_KS),
    *(f"specdec++:{h}" for h in SPECDEC_PP_THRESHOLDS),
    *(f"svip:{t}" for t in SVIP_THRESHOLDS),
    *(f"confidence:{t}" for t in CONFIDENCE_THRESHOLDS),
    "heuristic",
    "oracle",
    *HF_PEERS,
)


@dataclass(frozen=True)
class PolicySpec:
    name: str  # a policy of specdec.policies, or a peer in PEER_NAMES
    value: float | int | None = None  # K or threshold; None: the policy's default
    draft: str | None = None  # the engine's draft by name (`--also-draft NAME=SRC`); None: its first

    @property
    def key(self) -> str:
        """Canonical form: `fixed:4`, `svip:0.5`, `oracle`, `fixed:2@feature`."""
        point = self.name if self.value is None else f"{self.name}:{self.value:g}"
        return point if self.draft is None else f"{point}@{self.draft}"

    @property
    def family(self) -> str:
        """Which frontier a point belongs to: another draft's points are a family of their own."""
        family = "hf" if self.name in HF_PEERS else self.name
        return family if self.draft is None else f"{family}@{self.draft}"

    @property
    def is_peer(self) -> bool:
        return self.name in PEER_NAMES

    @property
    def greedy_only(self) -> bool:
        return self.name == "oracle"

    def policy_config(self) -> PolicyConfig:
        """The engine's policy flags (ours only)."""
        if self.value is None:
            return PolicyConfig(name=self.name)
        if self.name in K_NAMES:
            return PolicyConfig(name=self.name, k=int(self.value))
        return PolicyConfig(name=self.name, threshold=float(self.value))

    def __str__(self) -> str:
        return self.key


def parse_spec(text: str) -> PolicySpec:
    """`fixed:4` -> PolicySpec("fixed", 4), `fixed:4@feature` -> PolicySpec("fixed", 4, "feature");
    raises InvalidRequestError with a one-line reason."""
    point, at, draft = text.strip().partition("@")
    if at:
        if not draft:
            raise InvalidRequestError(f"policy spec {text!r}: name a draft after '@'")
        if draft == DEFAULT_DRAFT:  # the first draft's points keep their plain keys
            return parse_spec(point)
        spec = parse_spec(point)
        if spec.name == BASELINE:
            raise InvalidRequestError(f"policy spec {text!r}: target-only drafts nothing: drop '@{draft}'")
        if spec.is_peer:
            raise InvalidRequestError(f"policy spec {text!r}: HF's assisted generation runs the first draft (--draft) only")
        return PolicySpec(spec.name, spec.value, draft)
    name, sep, raw = point.partition(":")
    if name not in POLICY_NAMES and name not in PEER_NAMES:
        raise InvalidRequestError(
            f"unknown policy spec {text!r}; use one of {', '.join(POLICY_NAMES + PEER_NAMES)}, "
            "with :K or :THRESHOLD where it takes one")
    if not sep:
        return PolicySpec(name)
    if name in NO_VALUE_NAMES:
        raise InvalidRequestError(f"policy spec {text!r}: {name} takes no value")
    try:
        value: float | int = int(raw) if name in K_NAMES else float(raw)
    except ValueError:
        kind = "an integer K" if name in K_NAMES else "a threshold"
        raise InvalidRequestError(f"policy spec {text!r}: {raw!r} is not {kind}") from None
    try:  # the policies' own rules (policies/base.py)
        check_count("k", value) if name in K_NAMES else check_threshold(value)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"policy spec {text!r}: {exc}") from None
    return PolicySpec(name, value)


def parse_specs(texts: list[str] | tuple[str, ...]) -> list[PolicySpec]:
    """Parsed specs in the given order, duplicates (by canonical form) dropped."""
    specs: dict[str, PolicySpec] = {}
    for text in texts:
        spec = parse_spec(text)
        specs.setdefault(spec.key, spec)
    return list(specs.values())


def with_baseline(specs: list[PolicySpec]) -> list[PolicySpec]:
    """`specs` with target-only first unless it is there already: the baseline measured alongside
    them, at the same concurrency."""
    baseline = PolicySpec(BASELINE)
    return specs if baseline in specs else [baseline, *specs]
