"""The engine's stop conditions, samples, streaming and request validation (tiny models)."""

import pytest

from specdec.params import FINISH_LENGTH, FINISH_STOP, build_params
from specdec.errors import InvalidRequestError


def test_max_new_tokens_and_finish_reason(tiny_engine):
    result = tiny_engine.generate("hi", build_params(policy="fixed", k=3, max_new_tokens=7))
    (completion,) = result.completions
    assert len(completion.token_ids) == 7
    assert completion.finish_reason == FINISH_LENGTH
    assert result.stats.generated_tokens == 7


def test_eos_ends_generation(tiny_engine):
    baseline = tiny_engine.generate("hi", build_params(policy="target-only", max_new_tokens=12))
    eos = baseline.completions[0].token_ids[4]
    engine_eos = tiny_engine.rules.eos_token_ids
    tiny_engine.rules.eos_token_ids = frozenset({eos})
    try:
        result = tiny_engine.generate("hi", build_params(policy="fixed", k=3, max_new_tokens=12))
    finally:
        tiny_engine.rules.eos_token_ids = engine_eos
    ids = result.completions[0].token_ids
    assert ids == baseline.completions[0].token_ids[: ids.index(eos) + 1]
    assert result.completions[0].finish_reason == FINISH_STOP


def test_stop_string_truncates_text_and_ids(tiny_engine):
    baseline = tiny_engine.generate("hi", build_params(policy="target-only", max_new_tokens=20, temperature=1.0, seed=5))
    text = baseline.completions[0].text
    stop = text[6:8]
    cut = text.find(stop)
    result = tiny_engine.generate("hi", build_params(policy="target-only", max_new_tokens=20, temperature=1.0,
                                                     seed=5, stop=(stop,)))
    completion = result.completions[0]
    assert completion.text == text[:cut]
    assert completion.finish_reason == FINISH_STOP
    decoded = tiny_engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert stop in decoded and stop not in tiny_engine.tokenizer.decode(completion.token_ids[:-1], skip_special_tokens=True)


def test_streamed_text_equals_final_text(tiny_engine):
    pieces: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}

    finished: dict[int, str] = {}

    def on_update(index, new_ids, new_text, finish_reason):
        pieces.setdefault(index, []).append(new_text)
        ids.setdefault(index, []).extend(new_ids)
        if finish_reason:
            finished[index] = finish_reason

    params = build_params(policy="svip", max_new_tokens=24, temperature=0.8, seed=1, n=3)
    result = tiny_engine.generate("hello", params, on_update=on_update)
    assert len(result.completions) == 3
    for i, completion in enumerate(result.completions):
        assert "".join(pieces[i]) == completion.text
        assert ids[i] == completion.token_ids
        assert finished[i] == completion.finish_reason


def test_samples_are_independent_and_seeded(tiny_engine):
    params = build_params(policy="fixed", k=2, max_new_tokens=16, temperature=1.0, seed=11, n=3)
    first = tiny_engine.generate("abc", params)
    again = tiny_engine.generate("abc", params)
    assert [c.token_ids for c in first.completions] == [c.token_ids for c in again.completions]
    assert len({tuple(c.token_ids) for c in first.completions}) > 1
    assert first.stats.generated_tokens == sum(len(c.token_ids) for c in first.completions)


def test_chat_template_and_raw_prompt_differ(tiny_engine):
    chat = tiny_engine.encode_prompt("hi", chat_template=True)
    raw = tiny_engine.encode_prompt("hi", chat_template=False)
    assert raw == list("hi".encode()) or len(raw) == 2
    assert len(chat) > len(raw)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tiny_engine.encode_prompt(conversation, chat_template=False) == tiny_engine.encode_prompt(
        "hi\nyo", chat_template=False)  # (a conversation went through the template either way)


@pytest.mark.parametrize("flags, message", [
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"policy": "svip", "threshold": 1.5}, "must be in (0, 1)"),
    ({"policy": "fixed", "k": 0}, "k must be at least 1"),
    ({"policy": "specdec++"}, "needs an acceptance head"),
    ({"policy": "oracle", "temperature": 1.0}, "greedy"),
])
def test_bad_policy_flags(tiny_engine, flags, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny_engine.generate("hi", build_params(**flags))


@pytest.mark.parametrize("flags, field", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top-p"),
    ({"top_p": 1.5}, "top-p"),
    ({"top_k": -2}, "top-k: Input should be greater than or equal to -1"),
    ({"max_new_tokens": 0}, "max-new-tokens"),
    ({"n": 0}, "n"),
    ({"stop": tuple("abcdefghijklmnopq")}, "stop: at most 16 stop strings, got 17"),  # (as over HTTP)
])
def test_bad_sampling_flags_are_one_line(flags, field):
    with pytest.raises(InvalidRequestError) as info:
        build_params(**flags)
    message = str(info.value)
    assert message.startswith(field) and "\n" not in message


def test_a_top_k_of_minus_one_is_off_in_process(tiny_engine):
    """As over HTTP and gRPC (and `--top-k -1`): -1 or 0 = no top-k filter, as vLLM's."""
    assert build_params(top_k=-1).sampling.top_k == 0
    flags = {"temperature": 1.0, "seed": 3, "max_new_tokens": 8}
    off = tiny_engine.generate("hi", build_params(top_k=-1, **flags)).completions[0].token_ids
    assert off == tiny_engine.generate("hi", build_params(top_k=0, **flags)).completions[0].token_ids


@pytest.mark.parametrize("flags, field", [
    ({"policy": "fixed", "k": True}, "k"),
    ({"policy": "svip", "threshold": True}, "threshold"),
    ({"max_new_tokens": True}, "max-new-tokens"),
    ({"n": True}, "n"),
    ({"chat_template": 1}, "chat-template"),
    ({"temperature": True}, "temperature"),
    ({"temperature": 1.0, "top_k": True}, "top-k"),
    ({"seed": True}, "seed"),
])
def test_a_bool_for_a_number_is_refused_not_read_as_one(flags, field):
    """JSON's true is no number: pydantic's lax mode read it as 1 ({"policy": {"name": "fixed",
    "k": true}} ran with K = 1); refused as vLLM and OpenAI refuse it, as is a number for a bool."""
    with pytest.raises(InvalidRequestError) as info:
        build_params(**flags)
    message = str(info.value)
    assert message.startswith(f"{field}: Input should be a valid") and "\n" not in message


def test_a_json_request_is_refused_a_bool_for_a_number_but_not_an_int_for_a_float():
    from pydantic import ValidationError

    from specdec.params import GenerationParams

    with pytest.raises(ValidationError, match="policy.k\n  Input should be a valid integer"):
        GenerationParams.model_validate_json('{"policy": {"name": "fixed", "k": true}}')
    params = GenerationParams.model_validate_json('{"max_new_tokens": 5, "sampling": {"temperature": 1}, '
                                                  '"policy": {"name": "svip", "k": 3, "threshold": 0}}')
    assert (params.sampling.temperature, params.policy.threshold) == (1.0, 0.0)  # (the range is resolve_policy's)
    assert isinstance(params.policy.threshold, float) and params.max_new_tokens == 5


def test_empty_and_overlong_prompts(tiny_engine):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        tiny_engine.generate("   ", build_params())
    with pytest.raises(InvalidRequestError, match="context holds"):
        tiny_engine.generate("x" * (tiny_engine.max_context + 5), build_params(), )


def test_oracle_reuses_a_given_reference(tiny_engine):
    params = build_params(policy="oracle", max_new_tokens=12)
    ids = tiny_engine.encode_prompt("hi")
    reference = tiny_engine.generate_ids(ids, build_params(policy="target-only", max_new_tokens=12)).completions[0]
    decoded = tiny_engine.generate_ids(ids, params)
    reused = tiny_engine.generate_ids(ids, params, reference=reference.token_ids)
    assert reused.completions[0].token_ids == decoded.completions[0].token_ids == reference.token_ids
    def counts(stats):
        return stats.rounds, stats.draft_tokens, stats.accepted_tokens, stats.target_forward_passes

    assert counts(reused.stats) == counts(decoded.stats)
    assert reused.stats.discarded_tokens == 0  # the hindsight is exact: nothing drafted is thrown away


def test_an_engine_decodes_no_more_sessions_than_its_caches_hold():
    """Found by a bug hunt: the loop decoded up to 256 sessions at once (its stores' size) while a
    runtime's caches hold fewer (the static cache's 64 rows, llama.cpp's 64 sequences): past them a
    step's passes took the caches of sessions waiting their turn, and each of those re-prefilled its
    history at its next round. The engine caps the loop at what every runtime holds; the rest wait."""
    from tiny import tiny_model
    from specdec.engine import SpecDecEngine
    from specdec.loop import BatchConfig
    from specdec.models.pool import SlotPool
    from specdec.models.runtime import DraftRuntime, TargetRuntime
    from specdec.models.static import StaticOptions

    static = StaticOptions(slots=3, capacity=128)
    target, draft = tiny_model(64, hidden_size=16, layers=1, seed=1), tiny_model(64, hidden_size=16, layers=1, seed=2)
    engine = SpecDecEngine(DraftRuntime(draft, identity="d", kv="static", static=static),
                           TargetRuntime(target, kv="static", static=static), batch=BatchConfig(max_sessions_per_step=2))
    assert engine.loop.batch.max_live_sessions == 3
    evicted = []
    evict_one = SlotPool.evict_one

    def counting(pool, keep):
        taken = evict_one(pool, keep)
        evicted.append(taken)
        return taken

    params = build_params(policy="fixed", k=2, max_new_tokens=12)
    prompts = [[1 + i, 2, 3, 4, 5] for i in range(7)]
    alone = [engine.generate_ids(prompt, params).completions[0].token_ids for prompt in prompts]
    SlotPool.evict_one = counting
    try:
        together = [r.completions[0].token_ids for r in engine.generate_many(prompts, params)]
    finally:
        SlotPool.evict_one = evict_one
    assert together == alone
    assert not any(evicted)  # a slot was taken only from sessions that had finished


# Found by a bug hunt of the library API (each a test that failed before its fix)

def test_generate_many_refuses_params_or_references_that_do_not_match_the_prompts(tiny_engine):
    params = build_params(policy="fixed", k=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="3 prompts need as many params and references, got 2 and 3"):
        tiny_engine.generate_many([[5, 6]] * 3, [params] * 2)  # the third was dropped without a word
    with pytest.raises(ValueError, match="got 3 and 1"):
        tiny_engine.generate_many([[5, 6]] * 3, params, references=[[1]])


def test_a_prompt_id_that_is_not_an_integer_fails_its_request_alone(tiny_engine):
    """A float id passed validation and failed the whole step's pass on llama.cpp, the requests
    beside it included; numpy's integers still count."""
    import numpy as np

    params = build_params(policy="fixed", k=2, max_new_tokens=6)
    alone = tiny_engine.generate_ids([5, 72, 101], params).completions[0].token_ids
    for bad in ([104.0, 101.0], [True, 5], ["5"]):
        with pytest.raises(InvalidRequestError, match="prompt token ids must be integers, got"):
            tiny_engine.generate_many([[5, 72, 101], bad], params)
    assert tiny_engine.generate_ids(np.array([5, 72, 101]), params).completions[0].token_ids == alone


def test_calls_from_two_threads_take_turns_and_a_running_event_loop_is_no_obstacle(tiny_engine):
    """A second thread's call raised "a RoundLoop serves one event loop at a time"; a call made
    where an event loop runs (Jupyter, an async app) raised asyncio.run's refusal."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    params = build_params(policy="fixed", k=2, max_new_tokens=12)
    alone = tiny_engine.generate_ids([5, 72, 101], params).completions[0].token_ids
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: tiny_engine.generate_ids([5, 72, 101], params), range(2)))
    assert [r.completions[0].token_ids for r in results] == [alone, alone]

    async def in_a_running_loop():
        return tiny_engine.generate_ids([5, 72, 101], params)
    assert asyncio.run(in_a_running_loop()).completions[0].token_ids == alone


def test_a_call_cut_short_leaves_no_session_in_the_workers(tiny_engine):
    """Ctrl-C during a call cancelled the loop's releases too: each interrupt left its sessions'
    caches in the draft and the verifier until their TTL."""
    import os
    import signal

    params = build_params(policy="fixed", k=2, max_new_tokens=40, n=2)

    def interrupt(*_):  # Ctrl-C once tokens flow (asyncio.run cancels the call, then raises KeyboardInterrupt)
        if not interrupted:
            interrupted.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    interrupted = []

    with pytest.raises(KeyboardInterrupt):
        tiny_engine.generate_ids([5, 72, 101], params, on_update=interrupt)
    held = [len(w.sessions) for w in (tiny_engine.draft_worker, tiny_engine.verifier_worker)]
    assert held == [0, 0] and not tiny_engine.loop.calls._wire
    assert len(tiny_engine.generate_ids([5, 72, 101], params).completions) == 2
