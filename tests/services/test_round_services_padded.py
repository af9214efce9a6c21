"""The round services over gRPC with a draft of more padding rows than its target's (the builder fits
it: tests/core/test_padded_vocab.py): q travels at the target's width, and served output equals
the engine's."""

from __future__ import annotations

import torch

from services.transports import GrpcTransport
from specdec.builder import EngineConfig, build_engine
from specdec.loop import BatchConfig, RoundLoop
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from test_round_services import Servers, run
from tiny import byte_tokenizer, tiny_model


def save_model(path, rows: int, hidden: int, layers: int, seed: int, pad_scale: float):
    tokenizer = byte_tokenizer()
    model = tiny_model(rows, hidden, layers, seed, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    with torch.no_grad():  # its padding rows large: an unmasked one would be proposed
        model.model.embed_tokens.weight[len(tokenizer):] *= pad_scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_served_rounds_of_a_padded_pair_equal_the_engine(tmp_path):
    draft, target = save_model(tmp_path / "draft", 280, 16, 1, 1, 40.0), save_model(tmp_path / "target", 272, 32, 2, 2, 1.0)
    engine = build_engine(EngineConfig(draft=str(draft), target=str(target), head="none"), progress=False)
    servers = Servers(engine)
    try:
        fixed = PolicyConfig(name="fixed", k=3)
        for params in (GenerationParams(max_new_tokens=20, policy=fixed),
                       GenerationParams(max_new_tokens=20, policy=fixed, sampling={"temperature": 1.0, "seed": 7})):
            loop = RoundLoop(GrpcTransport(*servers.addresses), engine.rules, BatchConfig(overlap="off"))
            [served] = run(loop, [([5, 72, 101, 108], params)])
            local = engine.generate_ids([5, 72, 101, 108], params)
            assert served.completions[0].token_ids == local.completions[0].token_ids
            assert served.stats.draft_tokens > 0
    finally:
        servers.stop()
