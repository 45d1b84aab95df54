"""`hshare.patch` inside `generate` on tiny random Llama / Mistral models (GQA and MHA)."""

import pytest
import torch

import hshare
from hshare.selection import NO_TOKEN

from conftest import (WIDE, assert_generates_as_dense, assert_rows_equal_alone, cache_kwarg, generate_with_logits,
                      greedy, left_padded, letter_tokenizer, tiny_llama, tiny_mistral)

SMALL = dict(sink=2, local=4, heavy=6)  # N_c = 12, far below the prompts used here


@pytest.mark.parametrize("preset", ["ds", "hshare-1_2-1_2-1_2", "hshare-7_8-3_4-1_2"])
@pytest.mark.parametrize("lengths", [[37], [37, 20, 29]])
def test_budget_covering_context_equals_unpatched(llama, preset, lengths):
    ids, mask = left_padded(lengths)
    assert_generates_as_dense(llama, ids, mask, preset, **WIDE)


@pytest.mark.parametrize("preset,overrides", [
    ("ds", {}),
    ("hshare-1_2-1_2-1_2", {"plan_scope": "sample"}),
    ("hshare-3_4-3_4-1_2", {"plan_scope": "sample", "selection": "query_head"}),
    ("streaming", {"sink": 2, "local": 10}),
])
def test_padded_rows_equal_rows_alone(preset, overrides):
    model = tiny_llama(dtype=torch.float64)
    lengths = [30, 45, 11, 38]
    ids, mask = left_padded(lengths)
    config = {**SMALL, **overrides} if preset != "streaming" else overrides
    with hshare.patched(model, preset, **config):
        assert_rows_equal_alone(model, ids, mask, lengths, new_tokens=14)


def test_sparse_decoding_is_really_sparse():
    model = tiny_llama()
    ids, mask = left_padded([60, 44])
    dense = greedy(model, ids, mask, new_tokens=16)
    cache = None
    with hshare.patched(model, "ds", sink=1, local=2, heavy=2):
        cache = hshare.new_cache(model)
        sparse = greedy(model, ids, mask, new_tokens=16, **cache_kwarg(cache))
    assert cache.stats.sparse_steps == 15
    assert not torch.equal(sparse, dense), "a 5-token budget over 60 tokens should change the greedy output"


@pytest.mark.parametrize("preset,layers_scored,heads_scored,group", [
    ("ds", 4, 2, 1), ("hshare-1_2-1_2-1_2", 2, 1, 2), ("hshare-3_4-3_4-1_2", 3, 2, 2),
    ("hshare-7_8-3_4-1_2", 4, 2, 2),
])
@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
@pytest.mark.parametrize("scope", ["batch", "sample"])
def test_score_computations_follow_sharing_ratios(preset, layers_scored, heads_scored, group, selection, scope):
    model = tiny_llama(kv_heads=2)  # 4 layers, 4 query heads, 2 KV heads
    if selection == "query_head":
        heads_scored = {"ds": 4, "hshare-1_2-1_2-1_2": 2}.get(preset, 3)
    ids, mask = left_padded([40, 33, 50])
    hshare.patch(model, preset, selection=selection, plan_scope=scope, **SMALL)
    cache = hshare.new_cache(model)
    greedy(model, ids, mask, new_tokens=10, **cache_kwarg(cache))
    steps = 9  # the first new token comes from the prefill
    selections = -(-steps // group)
    assert cache.stats.decode_steps == cache.stats.sparse_steps == steps
    assert cache.stats.selection_steps == selections
    assert cache.stats.score_computations == selections * layers_scored * heads_scored * 3
    assert cache.stats.plans == (0 if preset == "ds" else 1)


def test_dense_layers_are_not_scored_and_are_exact():
    model = tiny_llama()
    ids, mask = left_padded([40, 33])
    hshare.patch(model, "ds", dense_layers=[0, 2], **SMALL)
    cache = hshare.new_cache(model)
    greedy(model, ids, mask, new_tokens=6, **cache_kwarg(cache))
    assert cache.stats.score_computations == 5 * 2 * 2 * 2
    assert cache.layers[0].policy is None and cache.layers[1].policy is not None


def test_plain_forward_is_exact_dense(llama):
    ids, mask = left_padded([25, 18])
    ref = llama(ids, attention_mask=mask).logits
    with hshare.patched(llama, "ds", **SMALL):
        assert torch.equal(llama(ids, attention_mask=mask).logits, ref)


def test_unpatch_restores_identical_outputs_and_patch_twice_is_harmless(llama):
    ids, mask = left_padded([40, 27])
    ref_tokens, ref_logits = generate_with_logits(llama, ids, mask)
    attention = [m for m in llama.modules() if type(m).__name__ == "LlamaAttention"]
    hooks_before = [len(m._forward_pre_hooks) for m in attention]
    hshare.patch(llama, "hshare-1_2-1_2-1_2", **SMALL)
    once = greedy(llama, ids, mask)
    hshare.patch(llama, "hshare-1_2-1_2-1_2", **SMALL)
    assert [len(m._forward_pre_hooks) for m in attention] == [h + 1 for h in hooks_before]
    assert torch.equal(greedy(llama, ids, mask), once)
    hshare.unpatch(llama)
    hshare.unpatch(llama)  # harmless
    assert [len(m._forward_pre_hooks) for m in attention] == hooks_before
    assert "generate" not in llama.__dict__ and llama.config._attn_implementation == "sdpa"
    tokens, logits = generate_with_logits(llama, ids, mask)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)


def test_patched_context_restores_previous_config():
    model = tiny_llama()
    hshare.patch(model, "ds", **SMALL)
    with hshare.patched(model, "hshare-1_2-1_2-1_2"):
        assert hshare.new_cache(model).config.sharing.layer == 0.5
    assert hshare.new_cache(model).config.name == "ds"


def test_unpatched_context_runs_the_stock_model_and_restores_the_patch():
    model = tiny_llama()
    ids, mask = left_padded([40, 31])
    stock = greedy(model, ids, mask)
    hshare.patch(model, "streaming", sink=2, local=4, heavy=0)
    streaming = greedy(model, ids, mask)
    assert not torch.equal(streaming, stock)  # the window is shorter than the prompts
    with hshare.unpatched(model):
        assert hshare.api.patch_state(model) is None and torch.equal(greedy(model, ids, mask), stock)
    assert hshare.new_cache(model).config.name == "streaming" and torch.equal(greedy(model, ids, mask), streaming)
    hshare.unpatch(model)
    with hshare.unpatched(model):  # an unpatched model stays unpatched
        pass
    assert hshare.api.patch_state(model) is None


def test_repeated_calls_with_other_batches_do_not_leak_state():
    model = tiny_llama()
    hshare.patch(model, "hshare-1_2-1_2-1_2", **SMALL)
    a_ids, a_mask = left_padded([40, 31, 52])
    b_ids, b_mask = left_padded([23])
    c_ids, c_mask = left_padded([70, 66, 15, 44, 30])
    first = greedy(model, a_ids, a_mask)
    greedy(model, b_ids, b_mask)
    greedy(model, c_ids, c_mask, new_tokens=20)
    assert torch.equal(greedy(model, a_ids, a_mask), first)


def test_sampling_and_num_return_sequences(llama):
    ids, mask = left_padded([33, 21])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=3,
                  pad_token_id=0)
    torch.manual_seed(3)
    ref = llama.generate(ids, **kwargs)
    with hshare.patched(llama, "hshare-1_2-1_2-1_2", **WIDE):
        torch.manual_seed(3)
        assert torch.equal(llama.generate(ids, **kwargs), ref)
    with hshare.patched(llama, "hshare-1_2-1_2-1_2", **SMALL):
        torch.manual_seed(5)
        one = llama.generate(ids, **kwargs)
        torch.manual_seed(5)
        assert torch.equal(llama.generate(ids, **kwargs), one)
        assert one.shape == (6, ids.shape[1] + 8)
        top1 = llama.generate(ids, **{**kwargs, "top_k": 1})  # sampling from one token: the copies agree
        assert all(torch.equal(top1[3 * r], top1[3 * r + i]) for r in range(2) for i in (1, 2))


@pytest.mark.parametrize("scope", ["batch", "sample"])
def test_beam_search(llama, scope):
    ids, mask = left_padded([36, 24])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    ref = llama.generate(ids, **kwargs)
    with hshare.patched(llama, "hshare-1_2-1_2-1_2", plan_scope=scope, **WIDE):
        assert torch.equal(llama.generate(ids, **kwargs), ref)
    with hshare.patched(llama, "hshare-1_2-1_2-1_2", plan_scope=scope, **SMALL):
        cache = hshare.new_cache(llama)
        out = llama.generate(ids, **cache_kwarg(cache), **kwargs)
        assert out.shape[0] == 2 and cache.stats.sparse_steps > 0


@pytest.mark.parametrize("padded", [False, True])
def test_mistral_sliding_window_respected(padded):
    model = tiny_mistral(sliding_window=24)
    ids, mask = left_padded([50, 36] if padded else [50])
    ref_tokens, ref_logits = generate_with_logits(model, ids, mask, new_tokens=12)
    for preset, overrides in (("dense", {}), ("ds", dict(sink=2, local=4, heavy=30))):  # N_c 36 >= window
        with hshare.patched(model, preset, **overrides):
            tokens, logits = generate_with_logits(model, ids, mask, new_tokens=12)
        assert torch.equal(tokens, ref_tokens), preset
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    with hshare.patched(model, "hshare-1_2-1_2-1_2", sink=2, local=3, heavy=5):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=12, **cache_kwarg(cache))
    windows = cache.planner.current.windows
    assert windows.n_valid.tolist() == [24] * len(ids)
    for layer in cache.layers:
        chosen = windows.critical_indices(layer.heavy)
        picked = chosen[chosen != NO_TOKEN]
        rows = torch.arange(len(ids))[:, None, None].expand_as(chosen)[chosen != NO_TOKEN]
        assert bool(windows.valid[rows, picked].all()), "a token outside the sliding window was selected"


def test_low_precision_decode_has_no_nan():
    model = tiny_llama(dtype=torch.bfloat16)
    ids, mask = left_padded([40, 25])
    with hshare.patched(model, "hshare-1_2-1_2-1_2", **SMALL):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    assert all(not logit.isnan().any() for logit in out.logits)


def test_memory_accounting():
    model = tiny_llama()  # 4 layers, 2 KV heads, head_dim 16, fp32
    ids, mask = left_padded([40, 40])
    hshare.patch(model, "ds", **SMALL)  # 16 channels of 4 bits + fp32 scale and zero per token
    cache = hshare.new_cache(model)
    greedy(model, ids, mask, new_tokens=5, **cache_kwarg(cache))
    tokens = 40 + 4
    assert cache.kv_bytes() == 4 * 2 * (2 * 2 * tokens * 16 * 4)
    assert cache.label_bytes() == 4 * 2 * 2 * tokens * (16 // 2 + 2 * 4)


def test_pipeline_text_generation():
    from transformers import pipeline

    tokenizer = letter_tokenizer()
    model = tiny_llama()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompt = "the quick brown fox jumps over the lazy dog " * 2
    ref = generator(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    hshare.patch(model, "ds", sink=1, local=2, heavy=500)
    assert generator(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"] == ref
    hshare.patch(model, "hshare-1_2-1_2-1_2", **SMALL)
    out = generator([prompt, prompt[:40]], max_new_tokens=8, do_sample=False)
    assert len(out) == 2 and out[0][0]["generated_text"].startswith(prompt)


def test_dense_fallback_below_threshold_is_exact_and_counted():
    model = tiny_llama()
    ids, mask = left_padded([60, 44])
    ref_tokens, ref_logits = generate_with_logits(model, ids, mask)
    with hshare.patched(model, "ds", sink=1, local=2, heavy=2, dense_fallback_mib=1.0):
        cache = hshare.new_cache(model)
        tokens, logits = generate_with_logits(model, ids, mask, **cache_kwarg(cache))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert cache.stats.dense_fallback_steps == cache.stats.decode_steps and cache.stats.sparse_steps == 0
    assert cache.stats.score_computations == 0  # no selection while dense
    # a threshold between the first and the last step: sparse (and selecting) once what it saves grows past it
    saved_bytes = lambda n: 2 * 2 * (n - 5) * 16 * 4 * 2  # rows x Hkv x (columns - N_c) x d x fp32 bytes x (K, V)
    with hshare.patched(model, "ds", sink=1, local=2, heavy=2, dense_fallback_mib=saved_bytes(65) / 2**20):
        cache = hshare.new_cache(model)
        generate_with_logits(model, ids, mask, **cache_kwarg(cache))
    assert cache.stats.dense_fallback_steps == 4 and cache.stats.sparse_steps == 5
    assert cache.stats.score_computations > 0
