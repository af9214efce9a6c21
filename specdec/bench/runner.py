"""The `specdec bench` run loop: every policy spec on every prompt at every temperature, in one
process on one engine, each generation timed alone and recorded as soon as it ends.

Order: temperature, then prompt, then policy, so a run stopped early holds every policy on the same
first prompts, and slow drifts of the machine (other load, heat) spread over all policies alike.
A rerun with the same --out skips the records already there (records.py).

With `concurrency` C > 1, C prompts of one policy run at once in the engine's batch (temperature,
then policy, then groups of C prompts); each record keeps its own request's stats and its group's
wall time, from which the report gives the aggregate tokens/s. Target-only runs in groups of C too,
added to the specs when they leave it out, so each policy's aggregate is compared with plain
decoding at the same load. HF's assisted generation runs one prompt at a time whatever C is.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm import tqdm

from specdec.bench.prompt_sets import PROMPT_SETS, load_prompts
from specdec.bench.records import RecordStore, divergence_key, read_json, record_key, temperature_key
from specdec.bench.specs import BASELINE, DEFAULT_POLICIES, LOOKUP_PEER, PolicySpec, parse_specs, with_baseline
from specdec.builder import EngineConfig, resolve_draft_quant, resolve_runtime, unfused
from specdec.errors import InvalidRequestError
from specdec.files import file_setting, write_atomically
from specdec.models.runtime import common_prefix_length
from specdec.models.sources import SHIPPED
from specdec.models.suffix import is_suffix_draft
from specdec.models.vocab import SETTINGS_BEFORE_DRAFT_VOCAB, vocab_setting
from specdec.params import DEFAULT_DRAFT, GenerationParams
from specdec.policies import HEAD_POLICIES, POLICIES, PolicyConfig
from specdec.sampling import SamplingParams

# The largest |logit| difference a runtime showed between passes of different sizes over the same
# tokens, rounded up: llama.cpp's quantized kernels up to ~0.9 on the default target (activations
# are quantized per pass; docs/benchmarks.md, benchmarks/llamacpp_numerics.py); torch in fp32 far
# less, in bf16 on a GPU a fraction of a logit (docs/performance.md, "On a GPU"). A greedy token chosen
# against a gap below it is a near-tie that the pass size can flip.
NEAR_TIE_LOGIT_GAP = {"llamacpp": 1.0, "torch": 0.25}
NOTES_FILE = "notes.json"  # what a --report-only run cannot recompute: skips, forward times, machine
WARMUP_TOKENS = 4


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = EngineConfig()
    policies: list[str] = Field(default_factory=lambda: list(DEFAULT_POLICIES))
    temperatures: list[Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = Field(default_factory=lambda: [0.0, 1.0],
                                                                                 min_length=1)
    prompts: str = "humaneval"
    limit: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    seed: int = 0  # prompt i samples with seed + i, the same for every policy
    out: Path = Path("bench-results")
    forward_ks: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4, 8, 16])  # empty: skip
    forward_repeats: int = Field(5, ge=1)
    chosen: list[str] = Field(default_factory=list)  # specs chosen on validation prompts (the goals use them)
    concurrency: int = Field(1, ge=1)  # prompts of one policy decoded at once (they share the batch)

    @field_validator("temperatures")
    @classmethod
    def _once_each(cls, temperatures: list[float]) -> list[float]:
        """`--temperatures 0 0.0` is one temperature (its records share a key): run once."""
        once: dict[str, float] = {}
        for temperature in temperatures:
            once.setdefault(temperature_key(temperature), temperature)
        return list(once.values())

    def settings(self) -> dict:
        """What every record depends on: a resumed run must match these. (The head only matters to
        specdec++ records, which carry its fingerprint: a new head redoes them and keeps the rest.)"""
        engine, first = self.engine, unfused(self.engine)  # (a fused draft's runtime: its model's)
        model = first.target if is_suffix_draft(first.draft) else first.draft  # (a model-free draft's: the target's)
        return {"runtime": resolve_runtime(first, model), "draft": engine.draft, "drafts": engine.drafts,
                "target": engine.target, "draft_format": engine.draft_format,
                "target_format": engine.target_format, "draft_vocab": vocab_setting(engine.draft_vocab),
                "draft_quant": resolve_draft_quant(engine), "device": engine.device, "threads": engine.threads,
                "dtype": engine.dtype, "kv_cache": engine.kv_cache, "cuda_graphs": engine.cuda_graphs,
                "prompts": self.prompts if self.prompts in PROMPT_SETS else file_setting(self.prompts),
                "max_new_tokens": self.max_new_tokens, "seed": self.seed, "concurrency": self.concurrency}


def read_notes(out: Path) -> dict:
    path = out / NOTES_FILE
    return read_json(path) if path.is_file() else {}


def write_notes(out: Path, notes: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / NOTES_FILE, json.dumps(notes, indent=1, sort_keys=True) + "\n")


def head_fingerprints(engine: EngineConfig) -> dict[str, str | None]:
    """Each draft's head fingerprint, by draft name."""
    from specdec.builder import draft_configs

    return {name: head_fingerprint(each) for name, each in draft_configs(engine).items()}


def head_fingerprint(engine: EngineConfig) -> str | None:
    """`path#sha256-prefix` of the head an engine with this config loads (its first draft's); None
    without one."""
    from specdec.head import WEIGHTS_FILE
    from specdec.heads import resolve_head

    path = resolve_head(engine.head, engine.draft)
    if path is None:
        return None
    weights = Path(path) / WEIGHTS_FILE
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.is_file() else "missing"
    return f"{path}#{digest}"


def same_head(recorded: str | None, current: str | None) -> bool:
    """Whether a record was made with the current head: the same weights (the digest after `#`),
    wherever the checkout that holds them lies (a run resumed from a clone or a worktree keeps its
    records)."""
    return (recorded and recorded.rpartition("#")[2]) == (current and current.rpartition("#")[2])


def cpu_name() -> str:
    """The CPU's model name (platform.processor() says only "x86_64" on Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def machine() -> dict:
    import transformers

    return {"cpu": cpu_name(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


class BenchRun:
    """One process's pass over whatever records are missing."""

    def __init__(self, config: BenchConfig, specs: list[PolicySpec], prompts: list[str], store: RecordStore,
                 progress: bool = True):
        self.config, self.specs, self.prompts, self.store, self.progress = config, specs, prompts, store, progress
        self.notes = read_notes(config.out)
        self.engine = None
        self.peers: dict = {}  # peer spec name -> its peer, loaded at first use
        self._prompt_ids: list[list[int] | None] = []
        self.head_ids = head_fingerprints(config.engine)  # by draft name
        self.cpu = cpu_name()  # in every record: a run resumed on another machine says so in its report

    def execute(self) -> dict:
        """Run what is missing; returns the notes (skips, chosen points, forward times, machine)."""
        from specdec.builder import build_engine

        self.engine = build_engine(self.config.engine, progress=self.progress)
        self._note_head()
        self._note_peers()
        self._note_one_hot()
        prompt_ids = self._prompt_ids = self._encode_prompts()
        todo = self._todo(prompt_ids)
        if todo:
            self._warm_up(prompt_ids)
        self._forward_times()
        self.notes["machine"], self.notes["head"] = machine(), self.head_ids[DEFAULT_DRAFT]
        if self.config.engine.drafts:
            self.notes["heads"] = self.head_ids
        self.notes["runtime"] = {"draft": type(self.engine.draft).__name__, "target": type(self.engine.target).__name__}
        write_notes(self.config.out, self.notes)
        bar = tqdm(total=len(todo), desc="bench", unit="gen", disable=not self.progress, file=sys.stderr,
                   dynamic_ncols=True)
        fresh: list[dict] = []
        for temperature, spec, indices in self._groups(todo):
            bar.set_postfix_str(f"t={temperature:g} prompt {indices[0]} {spec.key}", refresh=False)
            if self.config.concurrency == 1 or spec.is_peer:
                records = [self._generate(spec, temperature, indices[0], prompt_ids[indices[0]])]
            else:
                records = self._generate_group(spec, temperature, indices, [prompt_ids[i] for i in indices])
            for record in records:
                self.store.append(record)
            fresh += records
            bar.update(len(records))
        bar.close()
        self._rerun_contended(fresh, prompt_ids)
        profile = self.engine.cost_profile()
        if todo and profile is not None:  # what the budget planned with at the end of this run
            self.notes["live_profile"] = {**profile.model_dump(mode="json"), "drafting": self.engine.drafting}
        self._note_divergences(prompt_ids)
        self.notes["date"] = time.strftime("%Y-%m-%d")
        write_notes(self.config.out, self.notes)
        return self.notes

    def _rerun_contended(self, fresh: list[dict], prompt_ids: list[list[int] | None]) -> None:
        """Generate once more each record of this run that got much less CPU than the others
        (`report.contended_records`: something else had the cores); the new record replaces it."""
        from specdec.bench.report import contended_records

        names = set(contended_records(fresh, torch.get_num_threads()))
        again = [r for r in fresh if f"{r['spec']}@{r['temperature']:g}#{r['prompt']}" in names]
        if again:
            print(f"rerunning {len(again)} generation(s) timed while the CPU was shared", file=sys.stderr)
        specs = {s.key: s for s in self.specs}
        for r in again:
            self.store.append(self._generate(specs[r["spec"]], r["temperature"], r["prompt"], prompt_ids[r["prompt"]]))

    def close(self) -> None:
        """Free what the run's engine and peers hold beyond Python's memory (llama.cpp's models,
        captured graphs); the run is not used after."""
        for peer in self.peers.values():
            if hasattr(peer, "close"):  # (HF's peer runs the engine's own models)
                peer.close()
        self.peers.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ----------------------------------------------------------------------------------------

    def _note_peers(self) -> None:
        """HF's assisted generation runs the transformers models: only on the torch runtime, with a
        model draft; llama-cpp-python's prompt lookup, the target's GGUF: only on llama.cpp."""
        skipped = self.notes.setdefault("skipped_specs", {})
        on_torch = self.engine.draft.kind == self.engine.target.kind == "torch"
        for spec in self.specs:
            if spec.name == LOOKUP_PEER and self.engine.target.kind != "llamacpp":
                skipped[spec.key] = "llama-cpp-python's prompt lookup runs the target's GGUF: needs --runtime llamacpp"
            elif spec.name == LOOKUP_PEER:
                skipped.pop(spec.key, None)
            elif spec.is_peer and self.engine.draft.reads_features:
                skipped[spec.key] = "HF's assisted generation needs a model draft, not a feature draft"
            elif spec.is_peer and not on_torch:
                skipped[spec.key] = "HF's assisted generation runs transformers models: needs --runtime torch"
            elif spec.is_peer:
                skipped.pop(spec.key, None)

    def _note_one_hot(self) -> None:
        """svip and confidence stop on the draft's q, which a model-free draft's is one-hot
        (policies.check_model_free): skipped up front, not refused at their first generation."""
        skipped = self.notes.setdefault("skipped_specs", {})
        for spec in self.specs:
            if (spec.name in POLICIES and POLICIES[spec.name].traits.stops_on_q
                    and self.engine.rules.drafts[spec.draft or DEFAULT_DRAFT].model_free):
                skipped[spec.key] = "stops on the draft's distribution, and the suffix draft's is one-hot"

    def _note_head(self) -> None:
        """specdec++ and specdec++cost need a head; a head that records its validation-chosen h makes
        that h specdec++'s chosen operating point (and adds it to the sweep when missing)."""
        skipped = self.notes.setdefault("skipped_specs", {})
        wants_head = [s for s in self.specs if s.name in HEAD_POLICIES]
        for spec in wants_head:
            if self.engine.draft_workers[spec.draft or DEFAULT_DRAFT].head is None:
                skipped[spec.key] = ("no acceptance head for this draft: pass --head DIR" if spec.draft is None
                                     else f"no acceptance head for draft {spec.draft!r}: save one in its directory")
            else:
                skipped.pop(spec.key, None)
        if self.engine.head is None:
            return
        threshold = getattr(self.engine.head.config, "threshold", None)
        if any(s.name == "specdec++" and s.draft is None for s in wants_head) and threshold is not None:
            spec = PolicySpec("specdec++", float(threshold))
            if spec.key not in {s.key for s in self.specs}:
                self.specs.append(spec)
            self.notes.setdefault("chosen", {})["specdec++"] = {
                "spec": spec.key, "source": "head.json's h, chosen on validation prompts"}

    def _encode_prompts(self) -> list[list[int] | None]:
        """Token ids per prompt; None (and a note why) for one the run cannot decode in full."""
        skipped = self.notes.setdefault("skipped_prompts", {})
        encoded: list[list[int] | None] = []
        check = GenerationParams(max_new_tokens=self.config.max_new_tokens, policy=PolicyConfig(name="target-only"))
        for index, prompt in enumerate(self.prompts):
            try:
                ids = self.engine.encode_prompt(prompt)
                self.engine.validate(ids, check)
                if len(ids) + self.config.max_new_tokens > self.engine.max_context:
                    raise InvalidRequestError(f"{len(ids)} prompt tokens + {self.config.max_new_tokens} new tokens "
                                              f"exceed the models' context ({self.engine.max_context})")
            except InvalidRequestError as exc:
                skipped[str(index)] = str(exc)
                encoded.append(None)
                continue
            skipped.pop(str(index), None)
            encoded.append(ids)
        return encoded

    def _todo(self, prompt_ids: list[list[int] | None]) -> list[tuple[float, int, PolicySpec]]:
        skipped = self.notes.setdefault("skipped_specs", {})
        todo = []
        for temperature in self.config.temperatures:
            for spec in self.specs:
                if spec.greedy_only and temperature > 0:
                    skipped[f"{spec.key}@t={temperature:g}"] = ("greedy only: the hindsight oracle is defined "
                                                                "at temperature 0")
            for index, ids in enumerate(prompt_ids):
                if ids is None:
                    continue
                for spec in self.specs:
                    if spec.key in skipped or (spec.greedy_only and temperature > 0):
                        continue
                    done = self.store.get(record_key(spec.key, temperature, index))
                    if done is None or (spec.name in HEAD_POLICIES and not same_head(done.get("head"), self._head_id(spec))):
                        todo.append((temperature, index, spec))
        return todo

    def _groups(self, todo: list[tuple[float, int, PolicySpec]]) -> list[tuple[float, PolicySpec, list[int]]]:
        """(temperature, spec, prompt indices) to decode together: one prompt each at concurrency 1
        (and for HF's peer), else groups of `concurrency` prompts of one spec."""
        size = self.config.concurrency
        if size == 1:
            return [(temperature, spec, [index]) for temperature, index, spec in todo]
        order = {spec.key: i for i, spec in enumerate(self.specs)}
        groups: list[tuple[float, PolicySpec, list[int]]] = []
        for temperature, index, spec in sorted(todo, key=lambda t: (t[0], order[t[2].key], t[1])):
            last = groups[-1] if groups else None
            if (last and not spec.is_peer and last[0] == temperature and last[1].key == spec.key
                    and len(last[2]) < size):
                last[2].append(index)
            else:
                groups.append((temperature, spec, [index]))
        return groups

    def _peer(self, name: str):
        """The peer that runs the spec `name` (loaded at its first use)."""
        if name not in self.peers:
            if name == LOOKUP_PEER:
                from specdec.bench.peer import LOOKUP_SLACK, LlamaLookupPeer

                target = self.engine.target.llama
                context = max(len(ids) for ids in self._prompt_ids if ids is not None) + self.config.max_new_tokens
                self.peers[name] = LlamaLookupPeer(str(target.path), target.threads, context + LOOKUP_SLACK,
                                                   self.engine.eos_token_ids)  # the run's longest sequence
            else:
                from specdec.bench.peer import HFAssistedPeer

                hf = next((p for p in self.peers.values() if isinstance(p, HFAssistedPeer)), None)
                self.peers[name] = hf or HFAssistedPeer(self.engine.draft.model, self.engine.target.model,
                                                        self.engine.eos_token_ids)
        return self.peers[name]

    def _peer_generate(self, spec: PolicySpec, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                       seed: int) -> tuple:
        """(the peer's result, what the record notes of its mode)."""
        from specdec.bench.peer import LOOKUP_CPU_TOKENS, LOOKUP_NGRAM, peer_mode, threshold_adaptation

        if spec.name == LOOKUP_PEER:
            tokens = int(spec.value or LOOKUP_CPU_TOKENS)
            result = self._peer(spec.name).generate(prompt_ids, tokens, max_new_tokens, temperature, seed)
            return result, {"num_pred_tokens": tokens, "max_ngram_size": LOOKUP_NGRAM}
        mode = peer_mode(spec.name, spec.value)
        result = self._peer(spec.name).generate(prompt_ids, mode, max_new_tokens, temperature, seed)
        return result, {"num_assistant_tokens": mode.num_assistant_tokens, "schedule": mode.schedule,
                        "confidence_threshold": mode.confidence_threshold,
                        "threshold_adaptation": bool(mode.confidence_threshold) and threshold_adaptation()}

    def _warm_up(self, prompt_ids: list[list[int] | None]) -> None:
        """One short generation per code path, untimed: first calls pay for lazy initialisation."""
        ids = next((p for p in prompt_ids if p is not None), None)
        if ids is None:
            return
        for draft in dict.fromkeys(spec.draft for spec in self.specs if not spec.is_peer):  # each draft in use
            warm_up = GenerationParams(max_new_tokens=WARMUP_TOKENS, policy=PolicyConfig(name="fixed", k=2), draft=draft)
            self.engine.generate_ids(ids, warm_up)
        skipped = self.notes.get("skipped_specs", {})
        for spec in {spec.name: spec for spec in self.specs if spec.is_peer and spec.key not in skipped}.values():
            self._peer_generate(spec, ids, WARMUP_TOKENS, 0.0, self.config.seed)

    def _forward_times(self) -> None:
        ks = sorted(set(self.config.forward_ks))
        stored = self.notes.get("forward_times")
        if not ks or (stored and stored.get("ks") == ks):
            return
        from specdec.bench.forward import forward_time_curve

        if self.progress:
            print(f"timing forward passes over k = {ks} tokens", file=sys.stderr)
        repeats = self.config.forward_repeats
        self.notes["forward_times"] = {
            "ks": ks, "repeats": repeats,
            "draft_s": {str(k): t for k, t in forward_time_curve(self.engine.draft, ks, repeats).items()},
            "target_s": {str(k): t for k, t in forward_time_curve(self.engine.target, ks, repeats).items()}}

    def _base_record(self, spec: PolicySpec, temperature: float, index: int, prompt_ids: list[int]) -> dict:
        return {"spec": spec.key, "family": spec.family, "temperature": temperature, "prompt": index,
                "prompt_tokens": len(prompt_ids), "seed": self.config.seed + index, "cpu": self.cpu}

    def _generate(self, spec: PolicySpec, temperature: float, index: int, prompt_ids: list[int]) -> dict:
        seed = self.config.seed + index
        record = self._base_record(spec, temperature, index, prompt_ids)
        if spec.is_peer:
            result, record["peer"] = self._peer_generate(spec, prompt_ids, self.config.max_new_tokens, temperature,
                                                         seed)
            return {**record, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                    "stats": result.stats.to_dict()}
        cpu_start = time.process_time()  # every thread of this process: CPU it got, against the wall time
        result = self.engine.generate_ids(prompt_ids, self._params(spec, temperature, index),
                                          reference=self._oracle_reference(spec, temperature, index))
        record["process_cpu_s"] = time.process_time() - cpu_start
        return self._record(record, spec, result)

    def _generate_group(self, spec: PolicySpec, temperature: float, indices: list[int],
                        prompt_ids: list[list[int]]) -> list[dict]:
        start = time.perf_counter()
        results = self.engine.generate_many(prompt_ids, [self._params(spec, temperature, i) for i in indices],
                                            references=[self._oracle_reference(spec, temperature, i) for i in indices])
        wall_s = time.perf_counter() - start
        return [self._record({**self._base_record(spec, temperature, index, ids), "group": indices[0],
                              "group_wall_s": wall_s}, spec, result)
                for index, ids, result in zip(indices, prompt_ids, results)]

    def _params(self, spec: PolicySpec, temperature: float, index: int) -> GenerationParams:
        return GenerationParams(max_new_tokens=self.config.max_new_tokens, policy=spec.policy_config(),
                                sampling=SamplingParams(temperature=temperature, seed=self.config.seed + index),
                                draft=spec.draft)

    def _head_id(self, spec: PolicySpec) -> str | None:
        return self.head_ids[spec.draft or DEFAULT_DRAFT]

    def _record(self, record: dict, spec: PolicySpec, result) -> dict:
        if spec.name in HEAD_POLICIES:
            record["head"] = self._head_id(spec)
        completion = result.completions[0]
        return {**record, "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                "stats": result.stats.to_dict()}

    def _note_divergences(self, prompt_ids: list[list[int] | None]) -> None:
        """Where a greedy output differs from target-only's, the target's logits at the first
        differing token, as target-only's decoding computed them (report.py tells a near-tie of the
        target's top two from a defect)."""
        found = self.notes.setdefault("divergences", {})
        for index, prompt in enumerate(prompt_ids):
            reference = self.store.get(record_key(BASELINE, 0.0, index))
            if prompt is None or reference is None:
                continue
            for spec in self.specs:
                record = self.store.get(record_key(spec.key, 0.0, index))
                key = divergence_key(spec.key, index)
                if record is None or key in found or record["token_ids"] == reference["token_ids"]:
                    continue
                found[key] = first_divergence(self.engine.target, prompt, reference["token_ids"], record["token_ids"])

    def _oracle_reference(self, spec: PolicySpec, temperature: float, index: int) -> list[int] | None:
        """The oracle's hindsight is target-only's greedy output, which the run may hold already
        (the same prompt, budget and stops): reusing it saves one untimed target decode a prompt."""
        if spec.name != "oracle":
            return None
        done = self.store.get(record_key("target-only", temperature, index))
        return list(done["token_ids"]) if done is not None else None


def first_divergence(target, prompt: list[int], reference: list[int], tokens: list[int]) -> dict:
    """The first token where `tokens` leaves target-only's greedy `reference`, with the target's
    logit gap there, logit(reference's token) - logit(this token), from a one-token pass after the
    context as target-only decoding fed it (a prefill, then one token). A gap within the runtime's
    numerical noise (NEAR_TIE_LOGIT_GAP) is a near-tie that a pass of another size may flip; a
    length difference or a larger gap is not explained by rounding."""
    position = common_prefix_length(reference, tokens)
    entry = {"position": position, "target_only": reference[position] if position < len(reference) else None,
             "token": tokens[position] if position < len(tokens) else None, "gap": None, "near_tie": False}
    if entry["target_only"] is None or entry["token"] is None:
        return entry
    session = target.new_session()
    if position:
        target.score([session], [prompt + reference[:position - 1]], [[]])
    logits = target.score([session], [prompt + reference[:position]], [[]])[0][-1]  # [V]
    gap = float(logits[entry["target_only"]] - logits[entry["token"]])
    return {**entry, "gap": gap, "near_tie": abs(gap) <= NEAR_TIE_LOGIT_GAP[target.kind]}


def run_bench(config: BenchConfig, progress: bool = True, report_only: bool = False) -> dict:
    """Run what is missing (unless `report_only`), then write results.json, summary.md and the
    plots into config.out; returns the results."""
    from specdec.bench.report import build_results, write_outputs

    chosen = parse_specs(config.chosen)
    specs = parse_specs([*config.policies, *config.chosen])  # a chosen point is measured even off the sweep
    for spec in specs:
        if spec.draft is not None and spec.draft not in config.engine.drafts:
            raise InvalidRequestError(f"policy spec {spec.key!r}: no draft named {spec.draft!r} "
                                      f"(name it with --also-draft {spec.draft}=SOURCE)")
    if config.concurrency > 1:
        specs = with_baseline(specs)  # the baseline at the same load
    store = RecordStore(config.out)
    if report_only and not len(store):
        raise InvalidRequestError(f"--report-only: no records in {config.out}")
    store.check_settings(config.settings(), added={**SETTINGS_BEFORE_DRAFT_VOCAB, "concurrency": 1, "drafts": {},
                                                    "runtime": "torch",  # the only runtime before llama.cpp's
                                                    "draft_quant": SHIPPED,
                                                    # (runs before these were kept: their defaults)
                                                    "dtype": "auto", "kv_cache": "auto", "cuda_graphs": True})
    prompts = load_prompts(config.prompts, config.limit)
    if report_only:
        notes = read_notes(config.out)
    else:
        run = BenchRun(config, specs, prompts, store, progress)
        try:
            notes = run.execute()
        finally:
            run.close()
        specs = run.specs  # the head's own h may have joined the sweep
        if not len(store):  # (a summary of nothing would read as a run that measured)
            reasons = {**notes.get("skipped_prompts", {}), **notes.get("skipped_specs", {})}
            raise InvalidRequestError("nothing was measured: " + (f"{len(reasons)} prompts or policies skipped, e.g. "
                                                                  f"{next(iter(reasons.values()))}" if reasons else
                                                                  "no prompt and policy ran"))
    notes.setdefault("chosen", {})
    for spec in chosen:  # --chosen overrides the head's h; specdec++cost may be the chosen SpecDec++
        family = "specdec++" if spec.name in HEAD_POLICIES else spec.family
        notes["chosen"][family] = {"spec": spec.key, "source": "--chosen, picked on validation prompts"}
    specs = parse_specs([*(s.key for s in specs), *(c["spec"] for c in notes["chosen"].values())])
    results = build_results(store, specs, config, len(prompts), notes)
    write_outputs(results, config.out)
    return results


__all__ = ["BenchConfig", "BenchRun", "run_bench", "temperature_key"]
