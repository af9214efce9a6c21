"""Committing a round's tokens: incremental detokenization and stop strings (specdec/sequences.py)."""

from specdec.params import FINISH_LENGTH, FINISH_STOP, GenerationParams
from specdec.sequences import RequestRules, SampleState
from tiny import byte_tokenizer

TOKENIZER = byte_tokenizer()
RULES = RequestRules(TOKENIZER, eos_token_ids=(), max_context=256, vocab_size=len(TOKENIZER))


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_text_grows_by_whole_characters_and_ends_as_the_whole_decode():
    """'é' and '€' are 2 and 3 byte tokens: a round may end inside one. The streamed pieces never
    carry a half character, and the text is the whole text's decode."""
    tokens = ids("a é b €!")
    params = GenerationParams(max_new_tokens=len(tokens))
    sample, pieces = SampleState([1]), []
    for token in tokens:
        _, text = RULES.commit(sample, [token], params)
        pieces.append(text)
    assert sample.finish_reason == FINISH_LENGTH
    assert sample.text == "".join(pieces) == TOKENIZER.decode(tokens) == "a é b €!"
    assert not any("\ufffd" in piece for piece in pieces)
    assert sample.decoded == len(tokens)


def test_a_stop_string_before_a_half_character_cuts_in_the_same_round():
    """The round's text ends inside 'é' (held back), but the stop string before it is found now and
    the ids end with the token completing it."""
    before, stop, after = ids("ab"), ids("\n"), ids("é")
    params = GenerationParams(max_new_tokens=20, stop=("\n",))
    sample = SampleState([1])
    RULES.commit(sample, before, params)
    new_ids, text = RULES.commit(sample, stop + after[:1], params)
    assert sample.finish_reason == FINISH_STOP
    assert sample.text == "ab" and text == ""
    assert sample.generated == before + stop and new_ids == stop


def committed(tokens: list[int], per_round: int, stops: tuple[str, ...]) -> tuple[str, list[int], str]:
    """(text, ids, streamed text) of `tokens` committed `per_round` at a time."""
    params = GenerationParams(max_new_tokens=len(tokens), stop=stops)
    sample, streamed = SampleState([1]), ""
    for start in range(0, len(tokens), per_round):
        streamed += RULES.commit(sample, tokens[start:start + per_round], params)[1]
        if sample.finish_reason:
            break
    return sample.text, sample.generated, streamed


def test_the_stop_string_completed_first_decides_however_many_tokens_a_round_commits():
    """Found by a bug hunt: a round committing several tokens cut at the earliest start of any stop
    string in its text, while one token at a time stops at the first stop string completed:
    greedy output with stops changed with K (its policy, its costs, the load). "o" is completed
    at "hello" before "lo w" is."""
    tokens = ids("hello world")
    alone = committed(tokens, 1, ("lo w", "o"))
    assert alone == ("hell", ids("hello"), "hell")
    for per_round in (2, 4, 11):
        assert committed(tokens, per_round, ("lo w", "o")) == alone, per_round
    # both complete on the same token: the text stops before the earlier start, as one at a time
    assert committed(tokens, 11, ("lo", "o")) == committed(tokens, 1, ("lo", "o")) == ("hel", ids("hello"), "hel")


def test_a_chat_template_that_refuses_the_messages_is_the_requests_error():
    """Templates of Gemma, Mistral or Llama-2 raise on a system turn or roles that do not alternate:
    the client's input, a one-line 400 / INVALID_ARGUMENT, not an internal error."""
    import pytest

    from specdec.errors import InvalidRequestError

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    rules = RequestRules(tokenizer, eos_token_ids=(), max_context=256, vocab_size=len(tokenizer))
    assert rules.encode_messages([{"role": "user", "content": "hi"}]) == ids("hi")
    with pytest.raises(InvalidRequestError, match="chat template refuses these messages: System role not supported$"):
        rules.encode_messages([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])


def test_token_ids_given_as_a_prompt_say_where_they_go():
    """engine.generate(ids) failed with AttributeError: 'int' object has no attribute 'get'."""
    import pytest

    from specdec.errors import InvalidRequestError

    rules = RequestRules(byte_tokenizer(), eos_token_ids=(), max_context=256, vocab_size=256)
    with pytest.raises(InvalidRequestError, match=r"got int \(token ids go to generate_ids\)"):
        rules.encode_prompt([5, 6, 7])


def test_raw_text_of_blanks_is_a_prompt_a_conversation_of_blanks_is_not():
    """Found by a bug hunt: a raw prompt of blanks (" ", "\\n": code to continue) was refused as
    empty, where OpenAI's completions take it; a chat turn of blanks says nothing."""
    import pytest

    from specdec.errors import InvalidRequestError

    assert RULES.encode_prompt(" \n", chat_template=False) == ids(" \n")
    for prompt, template in (("", False), ("", True), ("  ", True)):
        with pytest.raises(InvalidRequestError, match="prompt is empty"):
            RULES.encode_prompt(prompt, chat_template=template)


def test_a_k_past_the_context_is_refused():
    """Found by a bug hunt: `--k 100000000` in process built the step planner's price grid that wide
    (a 2.24 GiB array, then a traceback). No round drafts past the context."""
    import pytest

    from specdec.errors import InvalidRequestError
    from specdec.params import build_params
    from specdec.planner import candidate_cap

    with pytest.raises(InvalidRequestError, match="k must be at most the models' context of 256 tokens, got 257"):
        RULES.validate(ids("hi"), build_params(policy="fixed", k=257))
    assert RULES.validate(ids("hi"), build_params(policy="fixed", k=256)).policy.k == 256

    class Sample:  # what the planner reads of a session
        def __init__(self, params):
            self.request = type("Request", (), {"params": params})()

    # and a budgeted round is priced no wider than the tokens its request may generate
    assert candidate_cap(Sample(build_params(policy="specdec++cost", k=200, max_new_tokens=16))) == 16
    assert candidate_cap(Sample(build_params(policy="specdec++cost", k=4, max_new_tokens=16))) == 4


def test_stop_strings_without_a_tokenizer_are_refused_not_ignored():
    """Found by a bug hunt: an engine of token ids only (no tokenizer) skipped the stop-string check
    while committing, so a request with stop strings ran on past them to max_new_tokens and finished
    "length", with no error."""
    import pytest

    from specdec.errors import InvalidRequestError

    rules = RequestRules(None, eos_token_ids=(), max_context=256, vocab_size=256)
    assert rules.validate([1, 2], GenerationParams(max_new_tokens=4)).stop == ()
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        rules.validate([1, 2], GenerationParams(max_new_tokens=4, stop=("\n",)))


def llama_like_tokenizer():
    """The byte tokenizer with a BOS its post-processor puts first (as Llama's does), and a chat
    template that writes the BOS itself (as Llama 3's does)."""
    from tokenizers import processors

    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    return tokenizer


def test_raw_text_gets_the_tokenizers_bos_a_chat_prompt_gets_one():
    """A raw prompt was encoded without special tokens: a Llama-family target lost the BOS it was
    trained behind, which transformers' tokenizer(prompt), vLLM's completions and llama.cpp add.
    The template writes its own, so a chat prompt has exactly one."""
    tokenizer = llama_like_tokenizer()
    bos = tokenizer.bos_token_id
    rules = RequestRules(tokenizer, eos_token_ids=(), max_context=256, vocab_size=len(tokenizer))
    assert rules.encode_prompt("hi", chat_template=False) == [bos, *ids("hi")]
    chat = rules.encode_prompt("hi")
    assert chat[0] == bos and chat.count(bos) == 1
    # without the template (none, or turned off): the contents joined, as raw text
    joined = [bos, *ids("a\nb")]
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert rules.encode_prompt(turns, chat_template=False) == joined
    tokenizer.chat_template = None
    assert rules.encode_messages(turns, raw_fallback=True) == joined


def test_a_tokenizer_without_bos_encodes_raw_text_as_before():
    """Qwen's tokenizer has no BOS: a raw prompt is its text's tokens alone."""
    assert RULES.encode_prompt("hi", chat_template=False) == ids("hi")
    assert RULES.encode_prompt([{"role": "user", "content": "hi"}], chat_template=False) == ids("hi")
