"""The llama.cpp runtime on tiny GGUF files written in the tests: outputs against transformers reading
the same file, rollback, many sessions in one pass, sequences and cache cells running out, greedy
equality with llama.cpp target-only decoding, and the engine built from GGUF sources."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.builder import (EngineConfig, build_engine, build_rules, check_runtime_settings, check_sources,
                             draft_configs, resolve_runtime)
from specdec.engine import SpecDecEngine
from specdec.errors import IncompatibleModelsError, ModelSourceError
from specdec.head import AcceptanceHead, HeadConfig
from specdec.loop import BatchConfig
from specdec.metrics import RequestStats
from specdec.models import sources
from specdec.models.llamacpp import (SILENT_PASS_MIN_TOKENS, LlamaCppDraftRuntime, LlamaCppError, LlamaCppOptions,
                                     LlamaCppRuntime, LlamaCppTargetRuntime)
from specdec.models.sources import GGUF_SUBDIR, requantize_gguf, resolve_gguf, sha256_file
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.sampling import MAX_SAMPLES_PER_REQUEST, SamplingParams, probs_from_logits
from stats import chi2_pvalue
from tiny import SMALL_TOKENS, byte_level_tokens, finish_gguf, noisy_weights, tiny_gguf_weights, write_tiny_gguf

HIDDEN = 32
# llama.cpp (F32 weights, its f16 KV cache) against transformers on the same weights; a wrong position
# or session changes logits by O(1) (their spread here is ~1).
ATOL = 0.05
PROMPTS = ([5, 17, 99, 200, 3], [42], [7, 7, 7, 120, 250, 31, 64, 9])


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(draft, target) GGUFs over the byte vocabulary; the draft is the target plus noise."""
    root = tmp_path_factory.mktemp("gguf-pair")
    vocab = len(byte_level_tokens())
    target = tiny_gguf_weights(vocab, HIDDEN, layers=2, ffn=64, seed=3, scale=0.3)
    return (write_tiny_gguf(root / "draft.gguf", noisy_weights(target, 0.05, seed=4)),
            write_tiny_gguf(root / "target.gguf", target))


@pytest.fixture(scope="module")
def hf_target(gguf_pair):
    path = gguf_pair[1]
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def options(**kw) -> LlamaCppOptions:
    return LlamaCppOptions(threads=1, context=kw.pop("context", 1024), sequences=kw.pop("sequences", 8), **kw)


@torch.inference_mode()
def hf_outputs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states[-1][0].float()


def test_logits_and_hidden_states_match_transformers_on_the_same_file(gguf_pair, hf_target):
    draft_path, target_path = gguf_pair
    target = LlamaCppTargetRuntime(target_path, options=options())
    ids = PROMPTS[2]
    logits = target.score([target.new_session()], [ids[:5]], [ids[5:]])[0]  # [4, V]: after ids[:5] .. ids
    expected_logits, _ = hf_outputs(hf_target, ids)
    assert expected_logits.std() > 10 * ATOL
    torch.testing.assert_close(logits, expected_logits[4:], atol=ATOL, rtol=0)

    draft = LlamaCppDraftRuntime(draft_path, options=options())
    hf_draft = AutoModelForCausalLM.from_pretrained(draft_path.parent, gguf_file=draft_path.name,
                                                    dtype=torch.float32).eval()
    session = draft.new_session()
    first = draft.start([session], [ids[:5]])[0]
    step = draft.step([session], [ids[5]])[0]
    expected_logits, expected_hidden = hf_outputs(hf_draft, ids[:6])
    torch.testing.assert_close(first.logits, expected_logits[4], atol=ATOL, rtol=0)
    torch.testing.assert_close(first.hidden, expected_hidden[4], atol=ATOL, rtol=0)  # after the final norm
    torch.testing.assert_close(step.hidden, expected_hidden[5], atol=ATOL, rtol=0)
    assert draft.hidden_size == HIDDEN and draft.vocab_size == len(byte_level_tokens())


def test_the_draft_outputs_only_the_positions_a_long_pass_reads(gguf_pair):
    draft_path, _ = gguf_pair
    draft = LlamaCppDraftRuntime(draft_path, options=options())
    hf_draft = AutoModelForCausalLM.from_pretrained(draft_path.parent, gguf_file=draft_path.name,
                                                    dtype=torch.float32).eval()
    ids = [(7 * i + 3) % 250 for i in range(3 * SILENT_PASS_MIN_TOKENS)]
    decode, computed = draft.llama.decode, []  # per llama_decode: (tokens computed as outputs, read)

    def spy(seqs, positions, tokens, outputs):
        computed.append((len(tokens) if draft.llama.hidden_on else sum(outputs), sum(outputs)))
        return decode(seqs, positions, tokens, outputs)

    draft.llama.decode = spy
    sessions = [draft.new_session(), draft.new_session()]
    first = draft.start(sessions, [ids, ids[:5]])  # unread: all but the last token of each
    assert computed == [(0, 0), (2, 2)]  # with hidden states on throughout: [(len(ids) + 5, 2)]
    expected_logits, expected_hidden = hf_outputs(hf_draft, ids)
    torch.testing.assert_close(first[0].logits, expected_logits[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[0].hidden, expected_hidden[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[1].hidden, expected_hidden[4], atol=ATOL, rtol=0)
    step = draft.step(sessions, [ids[0], ids[5]])  # a drafting step after it: outputs as before
    torch.testing.assert_close(step[0].hidden, hf_outputs(hf_draft, ids + ids[:1])[1][-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(step[1].hidden, expected_hidden[5], atol=ATOL, rtol=0)


def test_rollback_keeps_the_common_prefix_and_rescoring_matches_a_fresh_session(gguf_pair, hf_target):
    target = LlamaCppTargetRuntime(gguf_pair[1], options=options())
    session = target.new_session()
    history = PROMPTS[0]
    target.score([session], [history], [[1, 2, 3]])
    assert session.tokens == history + [1, 2, 3]
    target.rollback(session, len(history) + 1)  # y_1 accepted
    assert session.tokens == history + [1]
    logits = target.score([session], [history + [1, 9]], [[4, 5]])[0]
    assert session.tokens == history + [1, 9, 4, 5]
    expected, _ = hf_outputs(hf_target, history + [1, 9, 4, 5])
    torch.testing.assert_close(logits, expected[-3:], atol=ATOL, rtol=0)
    # A history that diverges inside the cache crops it there.
    logits = target.score([session], [history[:2] + [77]], [[6]])[0]
    assert session.tokens == history[:2] + [77, 6]
    expected, _ = hf_outputs(hf_target, history[:2] + [77, 6])
    torch.testing.assert_close(logits, expected[-2:], atol=ATOL, rtol=0)


def test_many_sessions_in_one_pass_each_get_their_own_outputs(gguf_pair, hf_target):
    target = LlamaCppTargetRuntime(gguf_pair[1], options=options())
    sessions = [target.new_session() for _ in PROMPTS]
    candidates = [[1, 2], [], [3, 4, 5, 6]]
    calls = target.forward_passes
    all_logits = target.score(sessions, list(PROMPTS), candidates)
    assert target.forward_passes == calls + 1  # one pass, three sessions, a different K each
    for prompt, cand, logits in zip(PROMPTS, candidates, all_logits):
        expected, _ = hf_outputs(hf_target, prompt + cand)
        torch.testing.assert_close(logits, expected[len(prompt) - 1:], atol=ATOL, rtol=0)
    assert len({s.handle for s in sessions}) == 3


def test_sessions_beyond_the_sequences_take_the_least_recently_used_and_re_prefill(gguf_pair, hf_target):
    target = LlamaCppTargetRuntime(gguf_pair[1], options=options(sequences=2))
    a, b, c = (target.new_session() for _ in range(3))
    target.score([a, b], [PROMPTS[0], PROMPTS[1]], [[1], [2]])
    target.score([b], [PROMPTS[1] + [2]], [[3]])  # b is now the most recently used
    target.score([c], [PROMPTS[2]], [[4]])  # takes a's sequence
    assert a.handle is None and a.tokens == [] and {b.handle, c.handle} == {0, 1}
    logits = target.score([a], [PROMPTS[0] + [1]], [[5]])[0]  # a re-prefills (evicting b)
    expected, _ = hf_outputs(hf_target, PROMPTS[0] + [1, 5])
    torch.testing.assert_close(logits, expected[-2:], atol=ATOL, rtol=0)
    # More sessions in one pass than sequences: it runs as several passes, all outputs right.
    sessions = [target.new_session() for _ in range(5)]
    results = target.score(sessions, [PROMPTS[i % 3] for i in range(5)], [[i] for i in range(5)])
    for i, logits in enumerate(results):
        expected, _ = hf_outputs(hf_target, PROMPTS[i % 3] + [i])
        torch.testing.assert_close(logits, expected[-2:], atol=ATOL, rtol=0)


def test_a_dropped_session_hands_its_sequence_back(gguf_pair):
    target = LlamaCppTargetRuntime(gguf_pair[1], options=options(sequences=2))
    sessions = [target.new_session() for _ in range(2)]
    target.score(sessions, [PROMPTS[0], PROMPTS[1]], [[1], [2]])
    assert target.pool._free == []
    del sessions
    gc.collect()
    keep = target.new_session()
    target.score([keep], [PROMPTS[2]], [[3]])  # reclaims both, takes one
    assert len(target.pool._free) == 1 and keep.handle is not None


def test_a_full_cache_evicts_other_sessions_and_a_session_that_cannot_fit_fails_clearly(gguf_pair, hf_target):
    target = LlamaCppTargetRuntime(gguf_pair[1], options=options(context=256, sequences=4))
    first, second = target.new_session(), target.new_session()
    long_a, long_b = list(range(1, 150)), list(range(100, 230))
    target.score([first], [long_a], [[1]])
    logits = target.score([second], [long_b], [[2]])[0]  # 150 + 131 cells > 256: first loses its cache
    assert first.tokens == [] and first.handle is None
    expected, _ = hf_outputs(hf_target, long_b + [2])
    torch.testing.assert_close(logits, expected[-2:], atol=ATOL, rtol=0)
    with pytest.raises(LlamaCppError, match="does not fit"):
        target.score([target.new_session()], [list(range(1, 250))], [[3] * 10])
    assert second.tokens == long_b + [2]  # the refused pass changed nothing


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity (Linux)")
def test_threads_default_to_the_cores_the_process_may_run_on(gguf_pair):
    """Found by a bug hunt: without `threads` llama.cpp took os.cpu_count(), every core of the machine,
    where the process may run on fewer (taskset, a container's or Slurm job's cpuset; torch's default
    follows them): on a 64-core host with 4 cores, 64 threads spinning at each pass's barriers."""
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("one core: nothing to restrict")
    import specdec
    code = (f"import os, sys; os.sched_setaffinity(0, {{{min(cores)}}}); "  # (before llama.cpp loads)
            "from specdec.models.llamacpp import LlamaCppOptions, LlamaCppTargetRuntime; "
            "r = LlamaCppTargetRuntime(sys.argv[1], options=LlamaCppOptions(context=256, sequences=4)); "
            "print(r.llama.threads, r.llama.lib.llama_n_threads(r.llama.context), "
            "r.llama.lib.llama_n_threads_batch(r.llama.context))")
    done = subprocess.run([sys.executable, "-c", code, str(gguf_pair[1])], capture_output=True, text=True,
                          cwd=Path(specdec.__file__).parents[1], check=True)
    assert done.stdout.split() == ["1", "1", "1"]


def generate(engine, prompt: list[int], policy: PolicyConfig, max_new_tokens: int = 40) -> list[int]:
    params = GenerationParams(max_new_tokens=max_new_tokens, policy=policy)
    return engine.generate_ids(prompt, params).completions[0].token_ids


@pytest.fixture(scope="module")
def llama_engine(gguf_pair):
    draft, target = gguf_pair
    config = EngineConfig(draft=str(draft), target=str(target), runtime="llamacpp", head="none", threads=1,
                          llamacpp=options())
    return build_engine(config, progress=False)


def test_a_closed_engine_frees_its_llamacpp_models_at_once_and_builds_again(gguf_pair, monkeypatch):
    """Found by reading engine.close(): the llama.cpp runtimes had none, and the slot pool's free
    callback holds each runtime in a reference cycle, so a closed engine's models and contexts
    waited for the garbage collector (a process that builds engines again held them all)."""
    draft, target = gguf_pair
    config = EngineConfig(draft=str(draft), target=str(target), runtime="llamacpp", head="none", threads=1,
                          llamacpp=options())
    engine = build_engine(config, progress=False)
    policy = PolicyConfig(name="fixed", k=4)
    expected = generate(engine, list(PROMPTS[0]), policy, 20)
    runtimes = (engine.draft, engine.target)
    contexts, freed, llama_free = [r.llama.context for r in runtimes], [], engine.target.llama.lib.llama_free
    monkeypatch.setattr(engine.target.llama.lib, "llama_free", lambda context: (freed.append(context),
                                                                              llama_free(context)))
    engine.close()  # (the engine holds the runtimes: no collector frees them here)
    assert freed == contexts and all(r.llama.context is None and r.llama.model is None for r in runtimes)
    engine.close()  # a second one does nothing
    assert freed == contexts
    with pytest.raises(LlamaCppError, match="closed"):  # a pass after it: one line, not a crash in llama.cpp
        engine.target.score([engine.target.new_session()], [list(PROMPTS[0])], [[1]])
    assert generate(build_engine(config, progress=False), list(PROMPTS[0]), policy, 20) == expected


def test_the_engine_runs_gguf_sources_on_llamacpp(llama_engine, gguf_pair, tmp_path):
    assert isinstance(llama_engine.draft, LlamaCppRuntime) and isinstance(llama_engine.target, LlamaCppRuntime)
    assert llama_engine.draft.identity.startswith("gguf-sha256:")
    assert resolve_runtime(EngineConfig(draft=str(gguf_pair[0])), str(gguf_pair[0])) == "llamacpp"
    assert resolve_runtime(EngineConfig(), "some/hf-dir") == "torch"
    with pytest.raises(ModelSourceError, match="reads GGUF files"):
        build_engine(EngineConfig(draft=str(tmp_path), target=str(gguf_pair[1]), runtime="llamacpp"), progress=False)


@pytest.mark.parametrize("policy", [PolicyConfig(name="fixed", k=4), PolicyConfig(name="svip", threshold=0.3),
                                    PolicyConfig(name="fixed", k=1)])
def test_greedy_output_equals_llamacpp_target_only(llama_engine, policy):
    for prompt in PROMPTS:
        expected = generate(llama_engine, prompt, PolicyConfig(name="target-only"))
        assert generate(llama_engine, prompt, policy) == expected


def test_greedy_sessions_batched_together_equal_each_alone(llama_engine):
    params = [GenerationParams(max_new_tokens=30, policy=PolicyConfig(name=name, k=k))
              for name, k in (("fixed", 3), ("fixed", 6), ("target-only", None))]
    batched = llama_engine.generate_many([list(p) for p in PROMPTS], params)
    for prompt, param, result in zip(PROMPTS, params, batched):
        alone = llama_engine.generate_ids(list(prompt), GenerationParams(max_new_tokens=30,
                                                                           policy=PolicyConfig(name="target-only")))
        assert result.completions[0].token_ids == alone.completions[0].token_ids


def test_sessions_that_together_outgrow_the_cache_take_turns(gguf_pair):
    """Found by a bug hunt: four sessions of 60 + 30 tokens on a 256-position cache all fed in one
    step, nothing outside the pass to evict: the decode failed, and with it every sample, after
    all their work (`--n 16 --max-new-tokens 512` of the default pair on its 8192 positions). Each
    sample reserves its prompt and tokens; those that do not fit wait."""
    draft, target = gguf_pair
    engine = build_engine(EngineConfig(draft=str(draft), target=str(target), runtime="llamacpp", head="none",
                                       threads=1, llamacpp=options(context=256)), progress=False)
    assert engine.loop.batch.max_live_positions == 256
    prompts = [[1 + i] + list(range(20, 79)) for i in range(4)]
    params = GenerationParams(max_new_tokens=30, policy=PolicyConfig(name="fixed", k=3))
    together = [r.completions[0].token_ids for r in engine.generate_many(prompts, params)]
    assert together == [generate(engine, p, PolicyConfig(name="target-only"), 30) for p in prompts]


def test_a_context_llamacpp_rounds_up_holds_what_was_asked(gguf_pair):
    """Found by a bug hunt: llama.cpp rounds its context up to a multiple of 256, and the engine took
    300 positions as 512 (a 400-token prompt was accepted, and 128 tokens generated where a served
    coordinator, which takes the limit as given, stopped at 300)."""
    from specdec.builder import build_rules

    draft, target = gguf_pair
    config = EngineConfig(draft=str(draft), target=str(target), runtime="llamacpp", head="none", threads=1,
                          llamacpp=options(context=200))  # (the tiny model's own context: 256)
    engine = build_engine(config, progress=False)
    assert engine.max_context == build_rules(config).max_context == 200
    assert engine.loop.batch.max_live_positions == 200
    result = engine.generate_ids(list(range(1, 191)), GenerationParams(max_new_tokens=100))
    assert len(result.completions[0].token_ids) == 10 and result.completions[0].finish_reason == "length"


# -- lossless on llama.cpp: sampled outputs follow the target as llama.cpp runs it ------------------------

SAMPLED_PROMPT = [1, 3]
SAMPLES = 1024  # 16 requests of 64 samples, all in one batch
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory):
    """A 10-token pair on llama.cpp, no EOS (every sample runs its full length)."""
    root = tmp_path_factory.mktemp("gguf-small")
    target = tiny_gguf_weights(len(SMALL_TOKENS), 16, layers=1, seed=5, scale=0.6)
    draft_path = write_tiny_gguf(root / "draft.gguf", noisy_weights(target, 0.15, seed=6), tokens=SMALL_TOKENS)
    target_path = write_tiny_gguf(root / "target.gguf", target, tokens=SMALL_TOKENS)
    return SpecDecEngine(LlamaCppDraftRuntime(draft_path, options=options(sequences=64)),
                         LlamaCppTargetRuntime(target_path, options=options(sequences=64, context=4096)))


def llamacpp_joint(target, prompt: list[int], sampling, length: int):
    """P(first `length` tokens) as llama.cpp's target computes it, one fresh session per prefix."""
    session = target.new_session()
    logits = target.score([session], [prompt], [[]])[0][0]
    probs = probs_from_logits(logits, sampling).double().numpy()
    if length == 1:
        return probs
    return np.stack([probs[t] * llamacpp_joint(target, prompt + [t], sampling, length - 1) for t in range(len(probs))])


@pytest.mark.parametrize("policy", [PolicyConfig(name="fixed", k=3), PolicyConfig(name="svip", threshold=0.5)])
def test_sampled_outputs_follow_the_llamacpp_target(small_vocab_engine, policy):
    sampling = SamplingParams(temperature=1.0)
    requests = [GenerationParams(max_new_tokens=3, n=MAX_SAMPLES_PER_REQUEST, policy=policy,
                                 sampling=sampling.model_copy(update={"seed": 500 + r}))
                for r in range(SAMPLES // MAX_SAMPLES_PER_REQUEST)]

    async def run():
        return await asyncio.gather(*(small_vocab_engine.loop.generate(SAMPLED_PROMPT, p) for p in requests))

    stats, completions = RequestStats(), []
    for result in asyncio.run(run()):
        completions += [c.token_ids for c in result.completions]
        stats.merge(result.stats)
    assert stats.accepted_tokens > 0 and stats.discarded_tokens > 0  # acceptances and rejections
    for length in (1, 2):
        expected = llamacpp_joint(small_vocab_engine.target, SAMPLED_PROMPT, sampling, length)
        observed = np.zeros([len(SMALL_TOKENS)] * length)
        for ids, count in Counter(tuple(ids[:length]) for ids in completions).items():
            observed[ids] += count
        pvalue = chi2_pvalue(observed, expected)
        assert pvalue > SIGNIFICANCE, f"first {length} token(s): chi-squared p = {pvalue:.2e}"


# -- the draft requantized for llama.cpp's fast kernels (--draft-quant) ------------------------------------

def tensor_types(path: Path) -> Counter:
    import gguf
    return Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)


def test_a_requantized_draft_is_made_once_in_the_cache_with_its_checksum(gguf_pair, tmp_path, monkeypatch):
    source = resolve_gguf(str(gguf_pair[0]), "draft", cache=tmp_path, progress=False)
    quantized = requantize_gguf(source, "q4_0", cache=tmp_path, progress=False)
    assert quantized.gguf.parent == tmp_path / GGUF_SUBDIR and quantized.meta_dir == source.meta_dir
    assert quantized.sha256 == sha256_file(quantized.gguf) != source.sha256
    assert tensor_types(quantized.gguf) == Counter({"Q4_0": sum(tensor_types(source.gguf).values())})
    assert tensor_types(source.gguf) == Counter({"F32": sum(tensor_types(source.gguf).values())})  # untouched

    def no_requantize(*args):
        raise AssertionError("requantized again")

    with monkeypatch.context() as m:  # a whole file with its marker is reused
        m.setattr(sources, "_requantize", no_requantize)
        assert requantize_gguf(source, "q4_0", cache=tmp_path, progress=False) == quantized
    with open(quantized.gguf, "r+b") as f:  # a cut file is made again
        f.truncate(quantized.gguf.stat().st_size // 2)
    assert requantize_gguf(source, "q4_0", cache=tmp_path, progress=False) == quantized
    with pytest.raises(ModelSourceError, match="unknown weight type 'q3'"):
        requantize_gguf(source, "q3", cache=tmp_path, progress=False)


def test_a_requantized_draft_keeps_greedy_output_equal_to_target_only(gguf_pair, tmp_path):
    draft, target = gguf_pair
    config = EngineConfig(draft=str(draft), target=str(target), runtime="llamacpp", head="none", threads=1,
                          llamacpp=options(), draft_quant="iq4_nl", cache_dir=str(tmp_path))
    engine = build_engine(config, progress=False)
    assert engine.draft.llama.path.name.endswith("-iq4_nl.gguf") and engine.target.llama.path == target
    drafted = 0
    for prompt in PROMPTS:
        expected = generate(engine, prompt, PolicyConfig(name="target-only"))
        params = GenerationParams(max_new_tokens=40, policy=PolicyConfig(name="fixed", k=4))
        result = engine.generate_ids(prompt, params)
        assert result.completions[0].token_ids == expected
        drafted += result.stats.draft_tokens
    assert drafted > 0
    with pytest.raises(ModelSourceError, match="needs the llamacpp runtime"):
        build_engine(config.model_copy(update={"runtime": "torch", "llamacpp": LlamaCppOptions()}), progress=False)
    shipped = resolve_gguf(str(draft), "draft", cache=tmp_path, progress=False)  # a head of the draft as shipped
    AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=1, draft_identity=shipped.identity)).save(tmp_path / "head")
    assert engine.draft.identity == f"{shipped.identity}+iq4_nl"  # named by its source and recipe
    with pytest.raises(IncompatibleModelsError, match=rf"{shipped.sha256[:12]}\), not this one "
                                                      rf"\({shipped.sha256[:12]}\+iq4_nl\); pass --head none"):
        build_engine(config.model_copy(update={"head": str(tmp_path / "head")}), progress=False)


def test_the_suffix_draft_on_llamacpp_equals_target_only(llama_engine, gguf_pair):
    """`--draft suffix` beside a GGUF target: its files are the target's, its rounds verified by llama.cpp."""
    from specdec.models.suffix import SuffixDraft

    engine = build_engine(EngineConfig(draft="suffix", target=str(gguf_pair[1]), runtime="llamacpp", threads=1,
                                       llamacpp=options()), progress=False)
    assert isinstance(engine.draft, SuffixDraft) and engine.draft.vocab_size == engine.target.vocab_size
    prompt = list(PROMPTS[0]) * 3  # a repeat for the draft to continue
    expected = generate(llama_engine, prompt, PolicyConfig(name="target-only"))
    for policy in (PolicyConfig(name="fixed", k=6), PolicyConfig(name="specdec++cost")):
        assert generate(engine, prompt, policy) == expected


def test_llama_cpp_pythons_prompt_lookup_peer_runs_the_target(llama_engine, gguf_pair):
    """The bench's `llamacpp-lookup` peer: llama-cpp-python's own loop on the target's GGUF, greedy."""
    from specdec.bench.peer import LlamaLookupPeer

    peer = LlamaLookupPeer(str(gguf_pair[1]), threads=1, context=256, eos_token_ids=llama_engine.eos_token_ids)
    prompt = list(PROMPTS[0]) * 3
    result = peer.generate(prompt, num_pred_tokens=2, max_new_tokens=24, temperature=0.0, seed=0)
    expected = generate(llama_engine, prompt, PolicyConfig(name="target-only"))
    assert result.token_ids == expected[:len(result.token_ids)] and result.stats.wall_time_s > 0
    peer.close()  # (the bench closes its peers when a run ends: the target's weights mapped twice)
    assert peer.llm._model.model is None


@pytest.mark.parametrize("update, reason", [
    ({"dtype": "bfloat16"}, "--dtype: only the torch runtime reads it"),
    ({"kv_cache": "static"}, "--kv-cache: only the torch runtime reads it"),
    ({"cuda_graphs": False, "device": "cuda"}, "--no-cuda-graphs, --device cuda: only the torch runtime"),
    ({"target_format": "int8"}, "--target-format: the torch runtime's weight formats"),
    ({"draft_format": "onednn"}, "--draft-format: the torch runtime's weight formats"),
    ({"batch": BatchConfig(max_tokens_per_pass=7)}, "--max-pass-tokens 7: a llama.cpp pass holds one output for "
                                                    "each of its 8 sequences"),  # (llama.cpp aborted the process)
])
def test_a_setting_no_model_reads_is_refused_before_any_loads(gguf_pair, update, reason):
    draft, target = gguf_pair
    config = EngineConfig(draft=str(draft), target=str(target), runtime="llamacpp", head="none", llamacpp=options())
    with pytest.raises(ModelSourceError, match=re.escape(reason)):
        check_runtime_settings(config.model_copy(update=update))
    check_runtime_settings(config)  # (as it is: nothing refused)


def test_a_suffix_draft_beside_keeps_no_weight_setting_of_the_first(gguf_pair):
    draft, target = gguf_pair
    config = EngineConfig(draft=str(draft), target=str(target), runtime="llamacpp", head="none", llamacpp=options(),
                          draft_quant="q4_0", drafts={"s": "suffix"})
    assert draft_configs(config)["s"].draft_quant == "auto"  # (the suffix refused q4_0: it has no weights)
    check_sources(config), check_runtime_settings(config)


def test_a_draft_with_another_tokenizer_is_named_as_the_user_gave_it(gguf_pair, tmp_path):
    """(The message named the draft's metadata folder in the model cache.)"""
    draft, target = gguf_pair
    tokens = byte_level_tokens()
    tokens[0], tokens[1] = tokens[1], tokens[0]  # the same size, other ids
    other = write_tiny_gguf(tmp_path / "other.gguf", noisy_weights(tiny_gguf_weights(len(tokens), HIDDEN, layers=2,
                                                                                   ffn=64, seed=3), 0.05, seed=4),
                            tokens=tokens)
    config = EngineConfig(draft=str(other), target=str(target), runtime="llamacpp", head="none", llamacpp=options(),
                          cache_dir=str(tmp_path / "cache"))
    with pytest.raises(IncompatibleModelsError, match=re.escape(f"the draft ({other}) and target tokenizers")):
        build_rules(config, progress=False)


# -- a recurrent model (one state per sequence, not a cache cell per position) ---------------------------

def write_tiny_mamba_gguf(path: Path, seed: int = 0, hidden: int = 16, d_state: int = 4, d_conv: int = 4,
                          dt_rank: int = 2) -> Path:
    """A one-layer Mamba GGUF over the byte vocabulary (llama.cpp's recurrent memory)."""
    import gguf

    tokens, d_inner = byte_level_tokens(), 2 * hidden
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.normal(0, 0.3, shape).astype(np.float32)

    weights = {"token_embd.weight": rand(len(tokens), hidden), "output_norm.weight": np.ones(hidden, np.float32),
               "blk.0.attn_norm.weight": np.ones(hidden, np.float32), "blk.0.ssm_in.weight": rand(2 * d_inner, hidden),
               "blk.0.ssm_conv1d.weight": rand(d_inner, d_conv), "blk.0.ssm_conv1d.bias": rand(d_inner),
               "blk.0.ssm_x.weight": rand(dt_rank + 2 * d_state, d_inner), "blk.0.ssm_dt.weight": rand(d_inner, dt_rank),
               "blk.0.ssm_dt.bias": rand(d_inner), "blk.0.ssm_a": -np.abs(rand(d_inner, d_state)) - 0.5,
               "blk.0.ssm_d": rand(d_inner), "blk.0.ssm_out.weight": rand(hidden, d_inner)}
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    return finish_gguf(writer, tokens, weights, path)


def test_a_recurrent_model_rolled_back_re_prefills_and_scores_as_a_fresh_session(tmp_path):
    """Found by a bug hunt: llama.cpp cannot cut a recurrent or hybrid model's state (Mamba, LFM2) back to
    a position (llama_memory_seq_rm returns false), so after the first rejected candidate the cache
    still held them and the next pass failed ("decode failed (status -1)": its positions no longer
    followed the sequence's)."""
    target = LlamaCppTargetRuntime(write_tiny_mamba_gguf(tmp_path / "mamba.gguf"), options=options(sequences=4))
    session, history = target.new_session(), list(PROMPTS[0])
    target.score([session], [history], [[1, 2, 3]])
    target.rollback(session, len(history) + 1)  # y_1 accepted, y_2 and y_3 rejected
    assert session.tokens in ([], history + [1])  # (re-prefilled from the start where the state cannot be cut)
    logits = target.score([session], [history + [1, 9]], [[4]])[0]
    assert session.tokens == history + [1, 9, 4]
    fresh = target.score([target.new_session()], [history + [1, 9]], [[4]])[0]
    torch.testing.assert_close(logits, fresh, atol=1e-3, rtol=0)


def test_a_recurrent_pair_keeps_greedy_output_equal_to_target_only(tmp_path):
    engine = SpecDecEngine(LlamaCppDraftRuntime(write_tiny_mamba_gguf(tmp_path / "draft.gguf", seed=1), options=options()),
                           LlamaCppTargetRuntime(write_tiny_mamba_gguf(tmp_path / "target.gguf"), options=options()))
    rejected = 0
    for prompt in PROMPTS:
        expected = generate(engine, list(prompt), PolicyConfig(name="target-only"), 30)
        result = engine.generate_ids(list(prompt), GenerationParams(max_new_tokens=30,
                                                                    policy=PolicyConfig(name="fixed", k=4)))
        assert result.completions[0].token_ids == expected
        rejected += result.stats.discarded_tokens
    assert rejected > 0  # (rounds rolled back)
