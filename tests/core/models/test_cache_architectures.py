"""The batched KV caches (slots, static) on decoder architectures other than Qwen2: a model whose
attention slides over a window shorter than its context runs on the batch-1 reference instead (the
slot and static attention see every cached position)."""

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
    return TargetRuntime(model, kv=kv, static=StaticOptions(slots=4, capacity=64))


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
