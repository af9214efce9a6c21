"""The batched KV caches (slots, static) on decoder architectures other than Qwen2: their outputs are
the model's own, and a model whose attention slides over a window shorter than its context runs on
the batch-1 reference instead (the slot and static attention see every cached position)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from specdec.models.cache import ReferenceKV
from specdec.models.runtime import TargetRuntime
from specdec.models.static import StaticOptions

VOCAB = 40
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=None, bos_token_id=None,
             eos_token_id=None, initializer_range=0.2)
HISTORIES = [[(7 * i + 3) % VOCAB for i in range(12)], [1, 2, 3], [5]]
CANDIDATES = [[4, 9, 9], [], [6, 2]]


def model_of(kind: str, **config):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPE, **config)).eval()
    return MistralForCausalLM(MistralConfig(**SHAPE, **config)).eval()


@torch.inference_mode()
def full_logits(model, sequence: list[int], rows: int) -> torch.Tensor:
    """The next-token logits after each of `sequence`'s last `rows` prefixes, from one plain forward."""
    return model(torch.tensor([sequence])).logits[0, -rows:].float()


def runtime(model, kv: str) -> TargetRuntime:
    """kv "padded": the static cache's passes padded to their graph buckets (what a CUDA graph replays)."""
    padded = dict(graphs=True, pad_off_cuda=True, min_graph_length=32) if kv == "padded" else {}
    return TargetRuntime(model, kv="static" if kv == "padded" else kv,
                         static=StaticOptions(slots=4, capacity=64, **padded))


@pytest.mark.parametrize("kv", ["slots", "static", "padded"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_model_without_layer_types_runs_batched_and_rolls_back(kind, kv):
    """Llama and Mistral (no sliding window) take no mask mapping: a batched pass used to fail in
    their mask builder ('dict' object has no attribute 'ndim')."""
    model = model_of(kind, **({"sliding_window": None} if kind == "mistral" else {}))
    target = runtime(model, kv)
    assert not isinstance(target.kv, ReferenceKV)  # batched, not the fallback
    assert kv != "padded" or target.kv.graphs
    sessions = [target.new_session() for _ in HISTORIES]
    histories = [list(h) for h in HISTORIES]
    for round_index in range(3):
        rows = target.score(sessions, histories, CANDIDATES)
        for history, candidates, logits in zip(histories, CANDIDATES, rows):
            torch.testing.assert_close(logits, full_logits(model, history + candidates, len(candidates) + 1),
                                       rtol=1e-4, atol=1e-4)
        for b, candidates in enumerate(CANDIDATES):  # each accepts a different prefix, then a correction
            accepted = (b + round_index) % (len(candidates) + 1)
            target.rollback(sessions[b], len(histories[b]) + accepted)
            histories[b] += candidates[:accepted] + [int(rows[b][accepted].argmax())]


@pytest.mark.parametrize("kv", ["slots", "static"])
def test_a_sliding_window_shorter_than_the_context_runs_on_the_reference(kv):
    """Mistral with a window of 8 scoring past position 8: the logits are the model's own, which
    attends only the window (the slot and static attention would attend every position)."""
    model = model_of("mistral", sliding_window=8)
    target = runtime(model, kv)
    assert isinstance(target.kv, ReferenceKV)
    history, candidates = [(5 * i + 1) % VOCAB for i in range(16)], [3, 7, 7, 1]
    [logits] = target.score([target.new_session()], [history], [candidates])
    torch.testing.assert_close(logits, full_logits(model, history + candidates, len(candidates) + 1),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv", ["slots", "static"])
def test_a_window_as_long_as_the_context_is_full_attention(kv):
    model = model_of("mistral", sliding_window=SHAPE["max_position_embeddings"])
    assert not isinstance(runtime(model, kv).kv, ReferenceKV)
