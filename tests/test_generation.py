"""dm.generate against model.generate: the model's generation config and generate's arguments
are honoured the way transformers honours them, or refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

import afdc
from afdc.demo import demo_batch
from afdc.lowering.cache_positions import cache_position_nodes
from models_supported import catalog
from models_supported.catalog import TINY_COMMON

VOCAB = TINY_COMMON["vocab_size"]


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_COMMON)).eval()
    return model, afdc.disaggregate(model)


def _with_config(model, dm, **values) -> None:
    """Both models decode with the stock generation config plus ``values`` (as a shipped
    generation_config.json would set them)."""
    config = GenerationConfig(**{**GenerationConfig.from_model_config(model.config).to_diff_dict(), **values})
    model.generation_config = config
    dm.generation_config = copy.deepcopy(config)


def _both(model, dm, **kwargs):
    ids, mask = demo_batch(VOCAB, seed=3, shape=(3, 9), pads=(4, 0, 2))
    torch.manual_seed(7)
    want = model.generate(ids, attention_mask=mask, **kwargs)
    torch.manual_seed(7)
    got = dm.generate(ids, attention_mask=mask, **kwargs)
    return want, got


# Generation-config values a shipped generation_config.json can hold that change greedy tokens
# (a function: of the tokens plain greedy decoding adds).
CONFIG_VALUES = {
    "repetition_penalty": {"repetition_penalty": 3.0},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 1},
    "forced_eos_token_id": {"forced_eos_token_id": 5, "eos_token_id": None},
    "bad_words_ids": lambda new: {"bad_words_ids": [[int(t)] for t in new[:, 0].unique()] + [[12, 13]]},
    "suppress_tokens": {"suppress_tokens": list(range(3, 60))},
    "begin_suppress_tokens": {"begin_suppress_tokens": list(range(3, 60))},
    "min_new_tokens": {"min_new_tokens": 7, "eos_token_id": list(range(2, 40))},
    "sequence_bias": {"sequence_bias": [[[17], 50.0]]},
    "eos_token_id": {"eos_token_id": list(range(2, 40))},
}


@pytest.mark.parametrize("name", CONFIG_VALUES)
def test_generation_config_values_are_honoured(llama, name):
    model, dm = llama
    _with_config(model, dm)
    plain, _ = _both(model, dm, max_new_tokens=8)
    values = CONFIG_VALUES[name]
    _with_config(model, dm, **(values(plain[:, -8:]) if callable(values) else values))
    want, got = _both(model, dm, max_new_tokens=8)
    assert not torch.equal(want, plain), f"{name} does not change this model's tokens: the test proves nothing"
    assert torch.equal(got, want)


def test_arguments_are_honoured_as_the_config_values_are(llama):
    model, dm = llama
    _with_config(model, dm)
    want, got = _both(model, dm, max_new_tokens=6, repetition_penalty=3.0, no_repeat_ngram_size=2)
    assert torch.equal(got, want)
    # max_length counts the prompt, as in generate; with neither, generate's default length
    want, got = _both(model, dm, max_length=12)
    assert got.shape[1] == 12 and torch.equal(got, want)
    want, got = _both(model, dm)
    assert torch.equal(got, want)


def test_a_generation_config_in_the_call_is_honoured_as_generate_honours_it(llama):
    model, dm = llama
    _with_config(model, dm)
    config = GenerationConfig(max_new_tokens=5, repetition_penalty=3.0, no_repeat_ngram_size=1)
    want, got = _both(model, dm, generation_config=config)
    assert want.shape[1] == 9 + 5 and torch.equal(got, want)


def test_without_a_mask_the_pad_tokens_of_the_input_are_masked_as_generate_masks_them(llama):
    """generate infers the mask from the pad token (unless it is also EOS); left-padded rows given
    without ``attention_mask`` must decode as they do there, not as if the padding were text."""
    model, dm = llama
    _with_config(model, dm)
    ids, mask = demo_batch(VOCAB, seed=3, shape=(3, 9), pads=(4, 0, 2))
    pad = 1  # a token this random model attends to differently from nothing (0 happens not to be)
    ids = ids.masked_fill(mask == 0, pad)
    assert not (ids[mask.bool()] == pad).any()
    want = model.generate(ids, max_new_tokens=6, pad_token_id=pad)
    got = dm.generate(ids, max_new_tokens=6, pad_token_id=pad)
    assert torch.equal(got, want)
    assert torch.equal(got, dm.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=pad))
    assert not torch.equal(got, dm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                            pad_token_id=pad)), "the padding changes nothing: the test proves nothing"


def test_sampling_draws_what_generate_draws(llama):
    model, dm = llama
    _with_config(model, dm, do_sample=True, top_k=20, temperature=0.7)
    want, got = _both(model, dm, max_new_tokens=6)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"num_beams": 2}, "beam_search"),
        ({"penalty_alpha": 0.5, "top_k": 4}, "contrastive_search"),
        ({"guidance_scale": 2.0}, "guidance_scale"),
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
        ({"return_dict_in_generate": True}, "return_dict_in_generate"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name_from_config_or_call(llama, values, named):
    model, dm = llama
    ids, mask = demo_batch(VOCAB)
    _with_config(model, dm)
    with pytest.raises(ValueError, match=named):
        dm.generate(ids, attention_mask=mask, max_new_tokens=2, **values)
    _with_config(model, dm, **values)
    with pytest.raises(ValueError, match=named):
        dm.generate(ids, attention_mask=mask, max_new_tokens=2)
    _with_config(model, dm)


def test_unknown_arguments_are_refused_by_name(llama):
    _, dm = llama
    ids, mask = demo_batch(VOCAB)
    with pytest.raises(TypeError, match="no_such_option"):
        dm.generate(ids, attention_mask=mask, no_such_option=1)


def test_cache_position_past_floor_scale_in_process_and_from_an_artifact(tmp_path):
    """Llama 4's NoPE layers scale queries by a temperature that grows with the cache position
    from ``floor_scale`` on: decode must see each token's position in the cache, not its index
    within the call. Left-padded batch, decoding well past ``floor_scale``."""
    entry = next(e for e in catalog.ENTRIES if e.model_type == "llama4_text")
    config = AutoConfig.for_model("llama4_text", **{**entry.config_kwargs, "floor_scale": 3, "attn_scale": 1.0})
    assert 0 in config.no_rope_layers  # a NoPE layer, whose temperature is tuned
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = demo_batch(VOCAB, seed=2, shape=(2, 10), pads=(3,))
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(afdc.disaggregate(model).generate(ids, attention_mask=mask, max_new_tokens=12), want)
    model.save_pretrained(tmp_path / "src")
    afdc.compile_model(str(tmp_path / "src"), "1A1F", tmp_path / "art", progress=False)
    got = afdc.load_deployment(tmp_path / "art").generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(got, want)
    # the serving worker finds the cache positions in the loaded program too (tests/test_paged.py
    # checks that vLLM-style flat batches then match transformers)
    assert cache_position_nodes(afdc.load(tmp_path / "art", "attn", 0).module.graph)
