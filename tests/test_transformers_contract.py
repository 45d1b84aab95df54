"""transformers' own behaviour is the spec: what ``generate`` offers, on a patched model, equals the
unpatched model's output for Llama, Mistral, Qwen2 and Qwen3, under ``dense`` and under a sparse preset
whose budget covers the context (where both must be exact); every refusal names what it refuses.

The cache argument is taken under either spelling (``cache=``, transformers 5.24's, and
``past_key_values=``, the earlier one) on every release in the tested range; the unpatched reference
passes it under the installed release's name (`hshare.compat.CACHE_KWARG`)."""

from __future__ import annotations

import warnings

import pytest
import torch
from packaging.version import Version
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, StaticCache,
                          StoppingCriteria, StoppingCriteriaList)
from transformers.generation.streamers import BaseStreamer

import hshare
from hshare import compat

from conftest import VOCAB, left_padded, letter_tokenizer, randomize_zeroed_weights

NEW = 8
WIDE = dict(sink=2, local=4, heavy=400)  # N_c above every context here: sparse decode must be exact
CONFIGS = {"dense": ("dense", {}), "sparse": ("hshare-1_2-1_2-1_2", WIDE)}
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
ARCHITECTURES = {  # (config class, model class, config): GQA 4/2 everywhere
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=24)),  # contexts here outgrow the window
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),  # q/k norms
}
SPELLINGS = ("cache", "past_key_values")
# the earlier spelling is passed on purpose: transformers warns of it from 5.24 on
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(architecture: str, seed: int = 0):
    config_class, model_class, extra = ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    return randomize_zeroed_weights(model_class(config_class(**SHAPE, **extra)).to(torch.float64).eval())


@pytest.fixture(params=sorted(ARCHITECTURES))
def architecture(request):
    return request.param


@pytest.fixture(params=sorted(CONFIGS))
def config(request):
    return CONFIGS[request.param]


def batch(seed: int = 0):
    """Three left-padded rows of 31, 18 and 26 tokens."""
    return left_padded([31, 18, 26], torch.Generator().manual_seed(seed))


def _generate(model, ids, mask, **kwargs):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0, **kwargs}
    return model.generate(ids, attention_mask=mask, **kwargs)


def _dict_output(out) -> dict:
    """The tensors of a ``return_dict_in_generate`` output that transformers defines per step."""
    result = {"sequences": out.sequences}
    for name in ("logits", "scores"):
        if getattr(out, name, None) is not None:
            result[name] = torch.stack(getattr(out, name), 1)
    if getattr(out, "sequences_scores", None) is not None:
        result["sequences_scores"] = out.sequences_scores
    return result


# ---- the generate features, each a function of (model, cache spelling) -> what it returns -------------
def greedy(model, spelling):
    ids, mask = batch()
    return _dict_output(_generate(model, ids, mask, output_logits=True, output_scores=True,
                                  return_dict_in_generate=True))


def sampling(model, spelling):
    ids, mask = batch(1)
    torch.manual_seed(7)
    return _dict_output(_generate(model, ids, mask, do_sample=True, top_k=0, temperature=1.3, output_scores=True,
                                  return_dict_in_generate=True))


def sampling_num_return_sequences(model, spelling):
    ids, mask = batch(2)
    torch.manual_seed(8)
    return {"sequences": _generate(model, ids, mask, do_sample=True, top_p=0.95, num_return_sequences=3)}


def beams(model, spelling):
    ids, mask = batch(3)
    return _dict_output(_generate(model, ids, mask, num_beams=3, num_return_sequences=2, output_scores=True,
                                  return_dict_in_generate=True))


def continue_from_returned_cache(model, spelling):
    """A second turn fed the first turn's returned cache (under the given spelling)."""
    ids, mask = batch(5)
    first = _generate(model, ids, mask, return_dict_in_generate=True)
    turn = torch.randint(3, VOCAB, (ids.shape[0], 5), generator=torch.Generator().manual_seed(6))
    ids2 = torch.cat((first.sequences, turn), 1)
    mask2 = torch.cat((mask, torch.ones(ids.shape[0], ids2.shape[1] - ids.shape[1], dtype=mask.dtype)), 1)
    second = _generate(model, ids2, mask2, output_logits=True, return_dict_in_generate=True,
                       **{spelling: compat.output_cache(first)})
    return _dict_output(second)


def user_static_cache(model, spelling):
    ids, mask = batch(7)
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW)
    return _dict_output(_generate(model, ids, mask, output_logits=True, return_dict_in_generate=True,
                                  **{spelling: cache}))


def user_dynamic_cache(model, spelling):
    ids, mask = batch(8)
    return _dict_output(_generate(model, ids, mask, output_logits=True, return_dict_in_generate=True,
                                  **{spelling: DynamicCache(config=model.config)}))


def static_cache_implementation(model, spelling):
    ids, mask = batch(9)
    return _dict_output(_generate(model, ids, mask, cache_implementation="static", output_logits=True,
                                  return_dict_in_generate=True))


class _Collect(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value.reshape(-1).clone())

    def end(self):
        self.ended = True


def streamer(model, spelling):
    """A streamer (one row, as transformers requires) sees the prompt, then each new token, then the end."""
    ids, mask = batch(10)
    row = ids[:1, -18:]
    collect = _Collect()
    out = _generate(model, row, torch.ones_like(row), streamer=collect)
    assert collect.ended
    return {"sequences": out, "streamed": torch.cat(collect.tokens)}


class _StopAfterMultipleOf(StoppingCriteria):
    """Rows stop, each at its own step, once their last token is a multiple of `divisor`."""

    def __init__(self, divisor: int):
        self.divisor = divisor

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] % self.divisor == 0


def stopping_criteria(model, spelling):
    ids, mask = batch(11)
    return {"sequences": _generate(model, ids, mask, max_new_tokens=3 * NEW,
                                   stopping_criteria=StoppingCriteriaList([_StopAfterMultipleOf(5)]))}


def eos_and_min_new_tokens(model, spelling):
    """Rows ending on an end-of-sequence token at different steps (the others go on), after a minimum."""
    ids, mask = batch(12)
    return {"sequences": _generate(model, ids, mask, max_new_tokens=3 * NEW, min_new_tokens=2,
                                   eos_token_id=list(range(3, VOCAB, 9)))}


FEATURES = [greedy, sampling, sampling_num_return_sequences, beams, streamer,
            stopping_criteria, eos_and_min_new_tokens, static_cache_implementation]
CACHE_FEATURES = [continue_from_returned_cache, user_static_cache, user_dynamic_cache]


def _assert_equal(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        if ref[name].is_floating_point():
            torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-9, msg=name)
        else:
            assert torch.equal(got[name], ref[name]), f"{name} differ"


@pytest.mark.parametrize("feature", FEATURES, ids=[f.__name__ for f in FEATURES])
def test_generate_feature_equals_unpatched(architecture, config, feature):
    model = tiny(architecture)
    ref = feature(model, compat.CACHE_KWARG)
    preset, overrides = config
    with hshare.patched(model, preset, **overrides):
        got = feature(model, compat.CACHE_KWARG)
    _assert_equal(got, ref)


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("feature", CACHE_FEATURES, ids=[f.__name__ for f in CACHE_FEATURES])
def test_a_cache_passed_under_either_spelling_equals_unpatched(architecture, config, feature, spelling):
    model = tiny(architecture)
    ref = feature(model, compat.CACHE_KWARG)
    preset, overrides = config
    with hshare.patched(model, preset, **overrides):
        got = feature(model, spelling)
    _assert_equal(got, ref)


def test_pipeline_equals_unpatched(architecture, config):
    from transformers import pipeline

    tokenizer = letter_tokenizer(padding_side="left")
    model = tiny(architecture)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompts = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen jugs"]
    kwargs = dict(max_new_tokens=NEW, do_sample=False, batch_size=2)
    ref = generator(prompts, **kwargs)
    preset, overrides = config
    with hshare.patched(model, preset, **overrides):
        assert generator(prompts, **kwargs) == ref


# ---- which cache ran, under which name --------------------------------------------------------------
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_hshare_cache_is_used_and_returned_under_the_installed_name(spelling):
    """generate makes an HShareCache when none is given and returns it under the installed release's
    field; a user's HShareCache passed under either spelling is the one filled; a forward takes it too."""
    model = tiny("llama")
    ids, mask = batch()
    hshare.patch(model, "hshare-1_2-1_2-1_2", sink=2, local=4, heavy=8)  # N_c 14 < context: sparse steps
    out = _generate(model, ids, mask, return_dict_in_generate=True)
    made = compat.output_cache(out)
    assert isinstance(made, hshare.HShareCache) and made.stats.score_computations > 0
    mine = hshare.new_cache(model)
    _generate(model, ids, mask, **{spelling: mine})
    assert mine.get_seq_length() == ids.shape[1] + NEW - 1 and mine.stats.score_computations > 0
    forward_cache = hshare.new_cache(model)
    model(ids, attention_mask=mask, **{spelling: forward_cache})
    assert forward_cache.get_seq_length() == ids.shape[1]


# ---- refusals: each names what it refuses and what is accepted --------------------------------------
def _both_spellings(model, ids, mask):
    _generate(model, ids, mask, cache=hshare.new_cache(model), past_key_values=hshare.new_cache(model))


def _output_attentions_generate(model, ids, mask):
    _generate(model, ids, mask, output_attentions=True, return_dict_in_generate=True)


def _output_attentions_forward(model, ids, mask):
    model(ids, attention_mask=mask, output_attentions=True)


def _other_cache_implementation(model, ids, mask):
    _generate(model, ids, mask, cache_implementation="offloaded")


def _continue_a_shared_prefix_cache(model, ids, mask):
    hshare.patch(model, "dense", prefix="on")
    cache = hshare.new_cache(model)
    same = ids[[0, 0]], mask[[0, 0]]  # two copies of one prompt: the prefix is held once
    first = _generate(model, *same, **{compat.CACHE_KWARG: cache})
    _generate(model, first, torch.ones_like(first), **{compat.CACHE_KWARG: cache})


REFUSALS = [
    (_both_spellings, "both cache= and past_key_values=.*accepted"),
    (_output_attentions_generate, "output_attentions=True.*accepted"),
    (_output_attentions_forward, "output_attentions=True.*accepted"),
    (_other_cache_implementation, "cache_implementation='offloaded'.*accepted"),
    (_continue_a_shared_prefix_cache, "shared-prefix layout.*accepted"),
]


@pytest.mark.parametrize("call,message", REFUSALS, ids=[call.__name__.strip("_") for call, _ in REFUSALS])
def test_refusals_name_what_is_refused(call, message):
    model = tiny("llama")
    ids, mask = batch()
    hshare.patch(model, "hshare-1_2-1_2-1_2", **WIDE)
    with pytest.raises(ValueError, match=message):
        call(model, ids, mask)


def test_unpatched_forward_after_a_refusal_is_untouched():
    """The forward refusal is the patch's: unpatching gives transformers' own attention weights back."""
    model = tiny("llama")
    model.set_attn_implementation("eager")
    ids, mask = batch()
    ref = model(ids, attention_mask=mask, output_attentions=True).attentions
    with hshare.patched(model, "dense"):
        with pytest.raises(ValueError, match="output_attentions"):
            model(ids, attention_mask=mask, output_attentions=True)
    again = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(again) == len(ref) == SHAPE["num_hidden_layers"]
    for a, b in zip(again, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # pad rows' weights are NaN in eager


# ---- the tested range ----------------------------------------------------------------------------
@pytest.mark.parametrize("installed", ["4.57.1", "5.16.1"])
def test_a_transformers_below_the_tested_range_is_refused_naming_both(monkeypatch, installed):
    monkeypatch.setattr(compat, "INSTALLED", Version(installed))
    with pytest.raises(RuntimeError, match=rf"transformers {installed}.*{compat.OLDEST_TESTED}.*{compat.NEWEST_TESTED}"):
        hshare.patch(tiny("llama"), "dense")


def test_a_transformers_above_the_tested_range_warns_naming_both(monkeypatch):
    newer = Version(compat.NEWEST_TESTED)
    installed = f"{newer.major}.{newer.minor + 1}.0"
    monkeypatch.setattr(compat, "INSTALLED", Version(installed))
    with pytest.warns(RuntimeWarning, match=rf"transformers {installed}.*{compat.NEWEST_TESTED}"):
        model = hshare.patch(tiny("llama"), "dense")
    ids, mask = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _generate(model, ids, mask)  # a warning at patch time, not at every call


def test_the_installed_transformers_is_in_the_tested_range():
    """What CI installs (both ends of the range) is inside it, and pyproject's bound says the same range."""
    import re
    from pathlib import Path

    minor = Version(f"{compat.INSTALLED.major}.{compat.INSTALLED.minor}")
    assert Version(compat.OLDEST_TESTED) <= minor <= Version(compat.NEWEST_TESTED)
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    low, high = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', pyproject).groups()
    newest = Version(compat.NEWEST_TESTED)
    assert Version(low) == Version(compat.OLDEST_TESTED)
    assert Version(high) == Version(f"{newest.major}.{newest.minor + 1}")
