import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.runtime.engine.detokenizer import Detokenizer, partial_stop_len
from ember.runtime.engine.tiny import train_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé 🙂 🚀 日本語 and 한국어 ❤️ done",
    "🎉🎉🎉",
    " leading space, trailing space ",
    "line one\nline two\n\ttabbed",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def stream(tokenizer, text, prompt="Hello there", **kw):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer, prompt_ids, **kw)
    deltas = [detok.step([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_full_decode_and_never_splits_a_character(tokenizer, text):
    deltas, _ = stream(tokenizer, text)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the tiny tokenizer must split emoji into byte tokens"
    detok = Detokenizer(tokenizer, [])
    assert [detok.step([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == "🙂"


def test_special_tokens_are_skipped_by_default_and_kept_on_request(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hello", add_special_tokens=False) + [eos]
    assert Detokenizer(tokenizer, []).step(ids, finished=True) == "Hello"
    kept = Detokenizer(tokenizer, [], skip_special_tokens=False).step(ids, finished=True)
    assert kept == "Hello<|im_end|>"


def test_stop_string_is_cut_and_never_leaks(tokenizer):
    deltas, detok = stream(tokenizer, "The capital of France is Paris, a city", stop=["Paris"])
    assert "".join(deltas) == "The capital of France is "
    assert detok.stop_reason == "Paris"


def test_stop_string_included_on_request(tokenizer):
    deltas, detok = stream(tokenizer, "one two three four", stop=["three"], include_stop_str_in_output=True)
    assert "".join(deltas) == "one two three"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, detok = stream(tokenizer, "alpha beta gamma delta", stop=["delta", "beta"])
    assert "".join(deltas) == "alpha "
    assert detok.stop_reason == "beta"


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop(tokenizer):
    deltas, detok = stream(tokenizer, "the cat sat on the mat", stop=["the dog"])
    assert "".join(deltas) == "the cat sat on the mat"
    assert detok.stop_reason is None


def test_tokens_after_a_stop_are_ignored(tokenizer):
    detok = Detokenizer(tokenizer, [], stop=["x"])
    assert detok.step(tokenizer.encode("abxcd", add_special_tokens=False)) == "ab"
    assert detok.step(tokenizer.encode("more", add_special_tokens=False), finished=True) == ""


def test_partial_stop_len():
    assert partial_stop_len("hello wor", ["world"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("aab", ["aabc", "bx"]) == 3
    assert partial_stop_len("xab", ["abab", "b"]) == 2 and partial_stop_len("", ["ab"]) == 0


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab\u00e9", max_size=30),
       stops=st.lists(st.text(alphabet="ab\u00e9", min_size=1, max_size=8), min_size=1, max_size=3))
def test_partial_stop_len_is_the_longest_suffix_that_begins_a_stop(text, stops):
    expected = max((k for stop in stops for k in range(1, min(len(stop) - 1, len(text)) + 1)
                    if text.endswith(stop[:k])), default=0)
    assert partial_stop_len(text, stops) == expected


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab c.é🙂日\n")), min_size=1, max_size=40),
    stop=st.text(alphabet=st.sampled_from(list("ab c.é🙂日")), min_size=1, max_size=4),
)
def test_streamed_text_equals_text_before_first_stop(tokenizer, text, stop):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer, [], stop=[stop])
    sent = ""
    for i, t in enumerate(ids):
        sent += detok.step([t], finished=i == len(ids) - 1)
        assert stop not in sent
        assert "\ufffd" not in sent
    cut = text.find(stop)
    assert sent == (text if cut < 0 else text[:cut])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_rust_decode_gives_what_the_tokenizers_decode_gives(tokenizer, skip_special_tokens):
    ids = tokenizer.encode("<|im_start|>user\nCafé 🙂 naïve<|im_end|>\n" + TEXTS[1], add_special_tokens=False)
    detok = Detokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    assert detok.decode.func == tokenizer.backend_tokenizer.decode   # the tiny tokenizer takes the fast path
    for end in range(len(ids) + 1):
        assert detok.decode(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_without_stop_strings_the_deltas_are_those_of_a_stop_that_never_matches(tokenizer, text):
    plain, _ = stream(tokenizer, text)
    searched, _ = stream(tokenizer, text, stop=["\x00never"])
    assert plain == searched


def window_only(detok: Detokenizer) -> Detokenizer:
    detok.stream = None  # the sliding window decodes every step, as where no DecodeStream can be had
    return detok


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab c.é🙂日\n")), min_size=1, max_size=40),
       steps=st.lists(st.integers(1, 4), min_size=1, max_size=40), cut=st.integers(0, 3),
       skip_special_tokens=st.booleans())
def test_decode_stream_and_window_give_the_same_deltas(tokenizer, text, steps, cut, skip_special_tokens):
    """Tokens in steps of 1-4, special tokens among them, and a request that may end mid-character (its last byte
    tokens cut off): the Rust DecodeStream path emits the window path's text, never later (it decodes a step's
    tokens one by one, so the complete characters before one still split go out at once)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = (ids[: len(ids) - cut] if cut < len(ids) else ids) + [eos] + tokenizer.encode("ok", add_special_tokens=False)
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    streamed = Detokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    windowed = window_only(Detokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens))
    assert streamed.stream is not None  # the tiny tokenizer takes the DecodeStream path
    batches, at = [], 0
    for size in steps:
        if at < len(ids):
            batches.append(ids[at:at + size])
            at += size
    if at < len(ids):
        batches.append(ids[at:])
    sent_streamed = sent_windowed = ""
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        sent_streamed += streamed.step(batch, finished=last)
        sent_windowed += windowed.step(batch, finished=last)
        assert sent_streamed.startswith(sent_windowed)
        assert "\ufffd" not in sent_streamed[len(sent_windowed):] or last
    assert sent_streamed == sent_windowed


def test_a_request_that_ends_mid_character_flushes_what_it_has(tokenizer):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    detok = Detokenizer(tokenizer, [])
    assert "".join(detok.step([t]) for t in ids[:-1]) == "ok "
    assert detok.step(ids[-1:], finished=True) == tokenizer.decode(ids)[3:]  # the partial character, as decoded
    long = Detokenizer(tokenizer, [])
    text = "".join(long.step([t]) for t in tokenizer.encode(TEXTS[0] * 20, add_special_tokens=False))
    assert text == TEXTS[0] * 20 and len(long.tokens) < 4 * 5 + 64 + 8  # only the window's tokens are kept


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_joined_steps_say_where_each_tokens_text_ends(tokenizer, text, windowed):
    """step_each (for outputs joined for a caller that fell behind): the text step gives, and after each token how
    long it is, which is where that token's text ends when decoded one by one (a byte of a character: none)."""
    one_by_one, _ = stream(tokenizer, text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = tokenizer.encode("Hello there", add_special_tokens=False)
    for cut in (2, 3, len(ids)):
        detok = Detokenizer(tokenizer, prompt_ids)
        if windowed:
            detok.stream = None   # as where no DecodeStream can be had
        pieces = []
        for at in range(0, len(ids), cut):
            joined, ends = detok.step_each(ids[at:at + cut], finished=at + cut >= len(ids))
            assert len(ends) == len(ids[at:at + cut]) and ends[-1] == len(joined)
            pieces += [joined[start:end] for start, end in zip([0, *ends], ends)]
        assert pieces == one_by_one
    with pytest.raises(ValueError, match="without stop strings"):
        Detokenizer(tokenizer, prompt_ids, stop=["x"]).step_each(ids)
