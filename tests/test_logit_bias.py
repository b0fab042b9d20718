"""logit_bias through the engine: it steers its own request's tokens and no other's."""

import pytest
from hf_models import save_random_model

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import MAX_LOGIT_BIAS


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_gguf):
    path = tmp_path_factory.mktemp("logit-bias") / "model"
    save_random_model("llama-gqa-tied", path)
    Tokenizer.from_gguf(smollm2_gguf).save(path)
    return LLM(path, num_pages=64, page_size=8, max_model_len=128, max_batch=4)


def greedy(max_tokens=6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_a_bias_steers_its_request_and_leaves_the_others_alone(llm):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    plain = [o.token_ids for o in llm.generate(prompts, greedy())]
    forced = greedy(logit_bias={42: 100.0})
    banned = greedy(logit_bias=dict.fromkeys(set(plain[2]), -100.0))
    outs = llm.generate(prompts, [greedy(), forced, banned])
    assert outs[0].token_ids == plain[0], "a neighbour's bias changed an unbiased row"
    assert outs[1].token_ids == [42] * 6
    assert not set(outs[2].token_ids) & set(plain[2])


def test_the_bias_is_checked():
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={-1: 1})
    with pytest.raises(ValueError, match=f"at most {MAX_LOGIT_BIAS}"):
        SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0))
    assert SamplingParams(logit_bias={3: 1}).logit_bias == ((3, 1.0),)
