"""Stop rules and released text of a request's output, on the real SmolLM2 tokenizer."""

import pytest

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import SamplingParams
from jaxserve.host.output_text import OutputText

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def feed(tokenizer, text: str, **params) -> tuple[OutputText, list[str], list[int]]:
    """The output of `text`'s tokens then EOS, fed until it stops; its pieces and tokens."""
    seq = OutputText([1], SamplingParams(**{"max_tokens": 100, **params}), tokenizer, (EOS,))
    pieces, ids = [], []
    for token in tokenizer.encode(text) + [EOS]:
        ids.append(token)
        pieces.append(seq.append(token))
        if seq.finished:
            break
    return seq, pieces, ids


def test_eos_stops_and_is_not_in_the_text(tokenizer):
    seq, pieces, ids = feed(tokenizer, "Hello world")
    assert seq.finish_reason == "stop" and seq.text == "Hello world"
    assert "".join(pieces) == seq.text and ids[-1] == EOS


def test_ignore_eos_and_min_tokens_hold_off_eos(tokenizer):
    seq, _, _ = feed(tokenizer, "Hi", ignore_eos=True)
    assert not seq.finished
    seq, _, _ = feed(tokenizer, "Hi", min_tokens=5)
    assert not seq.finished


def test_max_tokens_finishes_with_length(tokenizer):
    seq, _, ids = feed(tokenizer, "one two three four five", max_tokens=3)
    assert seq.finish_reason == "length" and len(ids) == 3
    assert seq.text == tokenizer.decode(ids)


def test_stop_token_ids(tokenizer):
    stop_id = tokenizer.encode(" three")[0]
    seq, _, _ = feed(tokenizer, "one two three four", stop_token_ids=[stop_id])
    assert seq.finish_reason == "stop" and seq.text == "one two"


@pytest.mark.parametrize("stop", ["ree f", "o t", "four", "e"])
def test_stop_strings_are_trimmed_exactly_across_tokens(tokenizer, stop):
    text = "one two three four five"
    seq, pieces, _ = feed(tokenizer, text, stop=[stop, "never"])
    assert seq.finish_reason == "stop"
    assert seq.text == text[: text.index(stop)]
    assert "".join(pieces) == seq.text  # nothing past the stop was ever released


def test_partial_stop_is_held_back_then_released(tokenizer):
    seq, pieces, _ = feed(tokenizer, "one two three", stop=["two four"])
    assert seq.finish_reason == "stop" and seq.text == "one two three"
    assert "".join(pieces) == "one two three"
    held = [p for p in pieces if p]
    assert not any(p.endswith(" two") for p in held[:-1])  # " two" waited for what followed
