"""A Llama-family pair through the whole engine (builder, tokenizer, EOS ids, every KV cache, the
policies, stop strings, the OpenAI routes): the shipped pair is Qwen2, whose tokenizer adds no BOS,
whose generation config names one EOS and whose model takes the mask mapping the slot and static
caches hand it; a Llama pair differs in all three.

The pair is tiny and random, shaped as Llama 3's: a byte tokenizer whose post-processor puts
<|begin_of_text|> first and whose chat template writes it too, three EOS ids in
generation_config.json (<|end_of_text|>, <|eom_id|>, <|eot_id|>, the tokenizer's eos_token the last),
llama3 RoPE scaling, an untied LM head. The draft is the target with noise on every weight, so rounds
accept candidates and the draft proposes the EOS ids too. Each EOS id is planted in the target's greedy continuation of
one prompt (its LM head row swapped with that of a token the target emits there)."""

from __future__ import annotations

import copy

import pytest
import torch
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdec.builder import EngineConfig, build_engine
from specdec.errors import IncompatibleModelsError
from specdec.head import AcceptanceHead, HeadConfig
from specdec.models.sources import model_identity
from specdec.params import build_params

BOS, END_OF_TEXT, EOM, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"
SPECIAL = [BOS, END_OF_TEXT, EOM, EOT, "<|start_header_id|>", "<|end_header_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
PROMPTS = ["def f(x):", "Hello there", "SELECT * FROM t", "Once upon a time", "import os\n", "1, 2, 3,",
           "The cat", "# TODO", "<html>", "x = [", "fn main() {", "Dear Sir,"]
NEW_TOKENS = 16
HEADLESS_POLICIES = ["target-only", "fixed", "svip", "heuristic", "confidence", "oracle"]


def llama_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT)
    fast.chat_template = CHAT_TEMPLATE
    return fast


@torch.inference_mode()
def greedy(model, prompt: list[int], stops=(), n: int = NEW_TOKENS) -> list[int]:
    """The model's own greedy continuation, one full forward a token (no cache)."""
    out = []
    for _ in range(n):
        out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
        if out[-1] in stops:
            break
    return out


def plant_eos(model, prompts: list[list[int]], eos: list[int]) -> dict[int, int]:
    """Swap LM head rows so that the greedy continuation of one prompt per EOS id ends with it at
    position 2 or later: {eos id: prompt index}. A swap of e and a token A makes the model emit e
    where it emitted A (the inputs, untied, are unchanged), so each chosen A must not appear before
    the chosen position in any chosen prompt's continuation."""
    runs = [greedy(model, p) for p in prompts]
    chosen: dict[int, tuple[int, int, int]] = {}  # eos -> (prompt, token A, position)
    for e in eos:
        for p, run in enumerate(runs):
            if p in {q for q, _, _ in chosen.values()}:
                continue
            fits = [(j, a) for j, a in enumerate(run) if j >= 2 and a not in run[:j] and a not in eos
                    and all(a not in runs[q][:k] and b not in run[:j] for q, b, k in chosen.values())]
            if fits:
                j, a = fits[0]
                chosen[e] = (p, a, j)
                break
    assert len(chosen) == len(eos), "no prompt's continuation can hold every EOS id: more prompts"
    with torch.no_grad():
        head = model.lm_head.weight
        for e, (_, a, _) in chosen.items():
            head[[e, a]] = head[[a, e]].clone()
    return {e: p for e, (p, _, _) in chosen.items()}


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """(draft dir, target dir, target model, token ids of the special tokens, {eos: prompt index})."""
    root = tmp_path_factory.mktemp("llama-pair")
    tokenizer = llama_tokenizer()
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    eos = [special[END_OF_TEXT], special[EOM], special[EOT]]
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        bos_token_id=special[BOS], eos_token_id=eos, pad_token_id=None)).eval()
    planted = plant_eos(target, [tokenizer.encode(p) for p in PROMPTS], eos)
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=generator))
    for name, model in (("draft", draft), ("target", target)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        # Llama 3's own: sampling settings the engine must not apply (its default is greedy)
        GenerationConfig(bos_token_id=special[BOS], eos_token_id=eos, do_sample=True, temperature=0.6,
                         top_p=0.9).save_pretrained(root / name)
    return root / "draft", root / "target", target, special, planted


@pytest.fixture(scope="module", params=["slots", "static", "reference"])
def engine(request, llama_pair):
    draft, target, *_ = llama_pair
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_engine(EngineConfig(draft=str(draft), target=str(target), runtime="torch", kv_cache=request.param,
                                    head="none"), progress=False)
    torch.set_num_threads(threads)


def test_one_bos_raw_or_chat_and_every_eos_id(engine, llama_pair):
    *_, special, _ = llama_pair
    bos = special[BOS]
    assert engine.eos_token_ids == {special[END_OF_TEXT], special[EOM], special[EOT]}
    raw = engine.encode_prompt("def f(x):", chat_template=False)
    chat = engine.encode_prompt("def f(x):")
    assert raw[0] == bos and raw.count(bos) == 1
    assert chat[0] == bos and chat.count(bos) == 1
    assert engine.encode_prompt([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                chat_template=False).count(bos) == 1


def test_greedy_equals_the_targets_own_under_every_policy(engine, llama_pair):
    """Every EOS id stops (planted in one prompt each), and the output is the target's own greedy
    decoding, its text without the EOS."""
    *_, target, special, planted = llama_pair
    eos = set(planted)
    for e, p in planted.items():
        prompt = engine.encode_prompt(PROMPTS[p], chat_template=False)
        expected = greedy(target, prompt, eos)
        assert expected[-1] == e
        for policy in HEADLESS_POLICIES:
            (completion,) = engine.generate_ids(prompt, build_params(policy=policy, max_new_tokens=NEW_TOKENS)
                                                ).completions
            assert (completion.token_ids, completion.finish_reason) == (expected, "stop"), policy
            assert completion.text == engine.tokenizer.decode(expected[:-1])
    chat = engine.encode_prompt(PROMPTS[0])
    expected = greedy(target, chat, eos)
    for policy in HEADLESS_POLICIES:
        (completion,) = engine.generate_ids(chat, build_params(policy=policy, max_new_tokens=NEW_TOKENS)).completions
        assert completion.token_ids == expected, policy
    drafted = engine.generate_ids(chat, build_params(policy="fixed", k=4, max_new_tokens=NEW_TOKENS))
    assert drafted.stats.accepted_tokens > 0  # (the rounds above accepted candidates, not only corrections)


def test_stop_strings(engine):
    full = engine.generate(PROMPTS[3], build_params(chat_template=False, max_new_tokens=NEW_TOKENS)).completions[0]
    stop = next(ch for ch in full.text[1:] if ch not in (full.text[0], "\ufffd"))  # first occurs mid-text
    for policy in HEADLESS_POLICIES:
        (completion,) = engine.generate(PROMPTS[3], build_params(chat_template=False, policy=policy, stop=(stop,),
                                                                 max_new_tokens=NEW_TOKENS)).completions
        assert (completion.text, completion.finish_reason) == (full.text[:full.text.index(stop)], "stop"), policy


def test_a_head_for_the_llama_draft_serves_it(llama_pair, tmp_path):
    """A head names its draft by model_identity of the draft's directory; one for another draft is
    refused. With the head, the head policies are lossless too."""
    draft, target, target_model, special, planted = llama_pair
    hidden = target_model.config.hidden_size
    AcceptanceHead(HeadConfig(hidden_size=hidden, depth=1, draft_identity=model_identity(draft))).save(tmp_path / "own")
    AcceptanceHead(HeadConfig(hidden_size=hidden, depth=1, draft_identity="b" * 64)).save(tmp_path / "foreign")
    config = EngineConfig(draft=str(draft), target=str(target), runtime="torch", head=str(tmp_path / "foreign"))
    with pytest.raises(IncompatibleModelsError, match="trained for another draft"):
        build_engine(config, progress=False)
    engine = build_engine(config.model_copy(update={"head": str(tmp_path / "own")}), progress=False)
    e, p = next(iter(planted.items()))
    prompt = engine.encode_prompt(PROMPTS[p], chat_template=False)
    expected = greedy(target_model, prompt, set(planted))
    for policy in ("specdec++", "specdec++cost", None):
        (completion,) = engine.generate_ids(prompt, build_params(policy=policy, max_new_tokens=NEW_TOKENS)).completions
        assert completion.token_ids == expected, policy


def test_openai_routes(engine):
    from engine_backend import EngineBackend
    from services.openai_api import create_app

    with TestClient(create_app(lambda: EngineBackend(engine), "llama")) as client:
        expected = engine.generate(PROMPTS[0], build_params(chat_template=False, max_new_tokens=NEW_TOKENS))
        body = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS}).json()
        assert body["choices"][0]["text"] == expected.completions[0].text
        assert body["usage"]["prompt_tokens"] == len(engine.encode_prompt(PROMPTS[0], chat_template=False))
        messages = [{"role": "user", "content": PROMPTS[1]}]
        expected = engine.generate_ids(engine.rules.encode_messages(messages), build_params(max_new_tokens=NEW_TOKENS))
        body = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": NEW_TOKENS}
                           ).json()
        assert body["choices"][0]["message"]["content"] == expected.completions[0].text
        assert body["choices"][0]["finish_reason"] == expected.completions[0].finish_reason
        assert body["usage"]["prompt_tokens"] == len(engine.rules.encode_messages(messages))
