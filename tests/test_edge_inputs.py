"""Edge inputs: each either works (exact against the unpatched model where it must be) or raises an
error that says what to change. Tiny random models, CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hshare
from hshare.config import ConfigError

from conftest import VOCAB, WIDE, cache_kwarg, left_pad, left_padded, tiny_llama, tiny_mistral
from property_support import assert_same_generation, generate

SMALL = dict(sink=1, local=2, heavy=3)  # N_c = 6
LAYERS, KV_HEADS = 4, 2  # tiny_llama


def tokens(n, seed=0):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def patched_run(model, ids, mask, new_tokens, preset, **overrides):
    with hshare.patched(model, preset, **overrides):
        cache = hshare.new_cache(model)
        seq, logits = generate(model, ids, mask, new_tokens, cache=cache)
    return seq, logits, cache


# ---- prompt of one token ------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["ds", "hshare-1_2-1_2-1_2", "quest", "streaming"])
def test_one_token_prompt_is_exact_until_the_context_outgrows_the_budget(preset):
    model = tiny_llama()
    ids = tokens(1)[None]
    mask = torch.ones_like(ids)
    new_tokens = 12
    ref_seq, ref_logits = generate(model, ids, mask, new_tokens)
    overrides = dict(SMALL, page_size=2) if preset.startswith("quest") else dict(SMALL)
    if preset == "streaming":
        overrides = dict(sink=1, local=5, heavy=0)
    seq, logits, cache = patched_run(model, ids, mask, new_tokens, preset, **overrides)
    budget = 6
    # decode step s sees 1 + s keys: dense (exact) up to s = N_c - 1, i.e. the first N_c tokens
    exact = budget  # logits 0 (prefill) .. N_c - 1 (step N_c - 1)
    assert_same_generation(ref_seq[:, :1 + exact], ref_logits[:, :exact], seq[:, :1 + exact], logits[:, :exact], 1,
                           2e-5)
    assert torch.isfinite(logits).all()
    stats = cache.stats
    assert stats.decode_steps == new_tokens - 1
    assert stats.sparse_steps == (new_tokens - 1) - (budget - 1)


def test_one_token_rows_next_to_longer_rows_with_a_shared_prefix_config():
    """A one-token prompt leaves no prefix to share (every row keeps an own token): the ordinary
    path runs, exact with a covering budget."""
    model = tiny_llama()
    prefix = tokens(20, seed=1)
    ids, mask = left_pad([tokens(1, seed=2), torch.cat((prefix, tokens(3, seed=3))), torch.cat((prefix, tokens(5)))])
    ref_seq, ref_logits = generate(model, ids, mask, 6)
    seq, logits, cache = patched_run(model, ids, mask, 6, "ds", prefix="on", **WIDE)
    assert_same_generation(ref_seq, ref_logits, seq, logits, ids.shape[1], 2e-5)
    assert cache.prefix is None


# ---- context exactly at the budget ----------------------------------------------------------------
@pytest.mark.parametrize("preset,overrides", [
    ("ds", dict(sink=2, local=3, heavy=5)),
    ("hshare-1_2-1_2-1_2", dict(sink=2, local=3, heavy=5)),
    ("quest", dict(sink=2, local=3, heavy=5, page_size=2)),
    ("streaming", dict(sink=2, local=8, heavy=0)),
])
def test_context_at_the_budget_is_dense_and_one_more_token_is_sparse(preset, overrides):
    """A row with exactly N_c keys attends to all of them (dense, exact, not counted sparse); with
    N_c + 1 keys the step is sparse and reads N_c keys per KV head."""
    budget = 10
    model = tiny_llama()
    for length, sparse in ((budget - 1, False), (budget, True)):  # the one decode step sees length + 1 keys
        ids = tokens(length, seed=length)[None]
        mask = torch.ones_like(ids)
        ref_seq, ref_logits = generate(model, ids, mask, 2)
        seq, logits, cache = patched_run(model, ids, mask, 2, preset, **overrides)
        stats = cache.stats
        assert stats.decode_steps == 1 and stats.sparse_steps == int(sparse), (length, stats)
        assert stats.dense_kv_rows == LAYERS * KV_HEADS * (length + 1)
        assert stats.kv_rows_read == LAYERS * KV_HEADS * min(length + 1, budget)
        if not sparse:
            assert_same_generation(ref_seq, ref_logits, seq, logits, length, 2e-5)


# ---- rows finishing early -------------------------------------------------------------------------
def _early_eos(model, ids, mask, new_tokens=14):
    """A token that row 0 generates at its third step and row 1 never generates: used as EOS, row 0
    finishes early while row 1 runs to the end."""
    seq, _ = generate(model, ids, mask, new_tokens)
    width = ids.shape[1]
    row0, row1 = seq[0, width:].tolist(), seq[1, width:].tolist()
    for step in range(2, 6):
        if row0[step] not in row1 and row0[step] not in row0[:step] and row0[step] != 0:
            return row0[step], step
    pytest.skip("no token finishes row 0 early on this random model")


def _finished_early(out, width, eos, step):
    return int(out[0, width + step]) == eos and bool((out[0, width + step + 1:] == 0).all())


def test_rows_finishing_early_while_others_continue():
    model = tiny_llama(dtype=torch.float64)
    ids, mask = left_padded([30, 44], torch.Generator().manual_seed(5))
    width = ids.shape[1]
    kwargs = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0)
    # covering budget: the same tokens as unpatched, row 0 stopped by its EOS and padded
    eos, step = _early_eos(model, ids, mask)
    ref = model.generate(ids, eos_token_id=eos, **kwargs)
    assert _finished_early(ref, width, eos, step) and ref.shape[1] == width + 14
    with hshare.patched(model, "hshare-1_2-1_2-1_2", **WIDE):
        assert torch.equal(model.generate(ids, eos_token_id=eos, **kwargs), ref)
    # sparse: row 0 stops at an EOS of its own sparse output; row 1 decodes on as it does alone
    with hshare.patched(model, "ds", sink=2, local=4, heavy=6):
        eos, step = _early_eos(model, ids, mask)
        cache = hshare.new_cache(model)
        out = model.generate(ids, **cache_kwarg(cache), eos_token_id=eos, **kwargs)
        alone = model.generate(ids[1:], eos_token_id=eos, **{**kwargs, "attention_mask": mask[1:]})
    assert cache.stats.sparse_steps == cache.stats.decode_steps == 13
    assert _finished_early(out, width, eos, step), "the finished row is not padded after its EOS"
    assert torch.equal(out[1], alone[0]), "a finished row changed a running row's tokens"


# ---- max_new_tokens 0 and 1 -------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["off", "on"])
def test_max_new_tokens_zero_raises_as_unpatched(prefix):
    model = tiny_llama()
    shared = tokens(12)
    ids, mask = left_pad([torch.cat((shared, tokens(3, 1))), torch.cat((shared, tokens(4, 2)))])
    with pytest.raises(ValueError, match="max_new_tokens") as unpatched:
        model.generate(ids, attention_mask=mask, max_new_tokens=0, pad_token_id=0)
    with hshare.patched(model, "ds", prefix=prefix, **SMALL):
        with pytest.raises(ValueError, match="max_new_tokens") as patched_error:
            model.generate(ids, attention_mask=mask, max_new_tokens=0, pad_token_id=0)
    assert str(patched_error.value) == str(unpatched.value)


@pytest.mark.parametrize("prefix", ["off", "on"])
def test_max_new_tokens_one_is_the_prefill_only_and_exact(prefix):
    model = tiny_llama()
    shared = tokens(12)
    ids, mask = left_pad([torch.cat((shared, tokens(9, 1))), torch.cat((shared, tokens(4, 2)))])
    ref_seq, ref_logits = generate(model, ids, mask, 1)
    seq, logits, cache = patched_run(model, ids, mask, 1, "ds", prefix=prefix, **SMALL)  # a small budget
    assert_same_generation(ref_seq, ref_logits, seq, logits, ids.shape[1], 2e-5)
    assert cache.stats.decode_steps == 0 and cache.stats.kv_rows_read == 0
    assert (cache.prefix is not None) == (prefix == "on")


# ---- use_cache=False --------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["ds", "hshare-1_2-1_2-1_2"])
def test_use_cache_false_runs_exact_dense(preset):
    """Without a cache every forward is a plain forward: exact dense attention, small budget or not."""
    model = tiny_llama()
    ids, mask = left_padded([30, 21], torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                  use_cache=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kwargs)
    with hshare.patched(model, preset, prefix="on", **SMALL):
        out = model.generate(ids, **kwargs)
    assert_same_generation(ref.sequences, torch.stack(ref.logits, 1), out.sequences, torch.stack(out.logits, 1),
                           ids.shape[1], 2e-5)


# ---- output_attentions=True -------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_output_attentions_is_refused_by_name(implementation):
    """A patched model returns no attention weights (sparse decode has none to give): asking for them
    stops with an error naming output_attentions and how to get them, whatever the model's attention
    implementation was (unpatched eager returns one tensor per layer and step)."""
    model = tiny_llama()
    model.set_attn_implementation(implementation)
    ids, mask = left_padded([20, 13])
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, output_attentions=True,
                  return_dict_in_generate=True)
    ref = model.generate(ids, **kwargs)
    if implementation == "eager":
        assert all(len(step) == LAYERS and step[0] is not None for step in ref.attentions)
    with hshare.patched(model, "ds", **WIDE):
        with pytest.raises(ValueError, match="output_attentions.*unpatch"):
            model.generate(ids, **kwargs)
        model.generation_config.output_attentions = True  # asked for through the generation config
        try:
            with pytest.raises(ValueError, match="output_attentions"):
                model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        finally:
            model.generation_config.output_attentions = False
    after = model.generate(ids, **kwargs)  # unpatched again: the weights as before
    assert torch.equal(after.sequences, ref.sequences)


# ---- output_hidden_states=True (the other per-position output) -------------------------------------
def _hidden_states_run(model, ids, mask, cache=None):
    return model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                          pad_token_id=0, output_hidden_states=True, return_dict_in_generate=True,
                          **cache_kwarg(cache))


def _assert_same_hidden_states(ref, out):
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.hidden_states) == len(ref.hidden_states)
    for step, (mine, theirs) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        for layer, (a, b) in enumerate(zip(mine, theirs)):
            assert a.shape == b.shape, f"step {step}, layer {layer}: hidden states {tuple(a.shape)} != {tuple(b.shape)}"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_output_hidden_states_without_a_shared_prefix_equal_unpatched():
    model = tiny_llama()
    ids, mask = left_padded([26, 23], torch.Generator().manual_seed(8))
    ref = _hidden_states_run(model, ids, mask)
    with hshare.patched(model, "ds", prefix="off", **WIDE):
        out = _hidden_states_run(model, ids, mask)
    _assert_same_hidden_states(ref, out)


def test_output_hidden_states_with_a_shared_prefix_cover_the_callers_prompt():
    model = tiny_llama()
    shared = tokens(20, seed=9)
    ids, mask = left_pad([torch.cat((shared, tokens(n, seed=n))) for n in (3, 6)])
    ref = _hidden_states_run(model, ids, mask)
    with hshare.patched(model, "dense", prefix="on"):
        _assert_same_hidden_states(ref, _hidden_states_run(model, ids, mask))


# ---- rope scaling (Llama 3.1) and tied embeddings ---------------------------------------------------
def llama31_tiny(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
        # Llama 3.1's scaling, with an original context short enough that the prompts here cross it
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("preset,prefix", [("ds", "off"), ("hshare-1_2-1_2-1_2", "off"), ("dense", "on"),
                                           ("ds", "on")])
def test_llama31_rope_scaling_and_tied_embeddings_exact(preset, prefix):
    model = llama31_tiny()
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    shared = tokens(30, seed=7)
    ids, mask = left_pad([torch.cat((shared, tokens(n, seed=n))) for n in (5, 11, 2)])
    ref_seq, ref_logits = generate(model, ids, mask, 8)
    seq, logits, cache = patched_run(model, ids, mask, 8, preset, prefix=prefix, **({} if preset == "dense" else WIDE))
    assert_same_generation(ref_seq, ref_logits, seq, logits, ids.shape[1], 2e-5)
    assert (cache.prefix is not None) == (prefix == "on")
    assert model.lm_head.weight is model.model.embed_tokens.weight, "patching untied the embeddings"


def test_llama31_sparse_decode_runs():
    model = llama31_tiny()
    ids, mask = left_padded([40, 27], torch.Generator().manual_seed(3))
    seq, logits, cache = patched_run(model, ids, mask, 10, "hshare-1_2-1_2-1_2", sink=2, local=4, heavy=6)
    assert torch.isfinite(logits).all() and cache.stats.sparse_steps == 9


# ---- fp16 / bf16 on CPU -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_cpu(dtype):
    model = tiny_llama(dtype=dtype)
    ids, mask = left_padded([30, 17, 25], torch.Generator().manual_seed(0))
    ref_seq, ref_logits = generate(model, ids, mask, 10)
    seq, logits, _ = patched_run(model, ids, mask, 10, "hshare-1_2-1_2-1_2", **WIDE)
    assert_same_generation(ref_seq, ref_logits, seq, logits, ids.shape[1], 2e-2)  # covering budget
    seq, logits, cache = patched_run(model, ids, mask, 10, "hshare-1_2-1_2-1_2", sink=2, local=4, heavy=6)
    assert torch.isfinite(logits).all()
    assert cache.stats.sparse_steps == 9
    assert cache.layers[0].keys.dtype == dtype


# ---- two models in one process, one patched ---------------------------------------------------------
def test_two_models_in_one_process_one_patched():
    plain, other = tiny_llama(seed=0), tiny_llama(seed=1)
    ids, mask = left_padded([40, 27], torch.Generator().manual_seed(4))
    before_seq, before_logits = generate(plain, ids, mask, 10)
    forward_before = plain(ids, attention_mask=mask).logits
    hshare.patch(other, "ds", **SMALL)
    try:
        cache = hshare.new_cache(other)
        generate(other, ids, mask, 10, cache=cache)
        assert cache.stats.sparse_steps == 9
        after_seq, after_logits = generate(plain, ids, mask, 10)
        assert torch.equal(after_seq, before_seq) and torch.equal(after_logits, before_logits)
        assert torch.equal(plain(ids, attention_mask=mask).logits, forward_before)
        assert plain.config._attn_implementation == "sdpa" and "generate" not in plain.__dict__
        assert all(not m._forward_pre_hooks for m in plain.modules() if type(m).__name__ == "LlamaAttention")
        with pytest.raises(ValueError, match="not patched"):
            hshare.new_cache(plain)
        generate(other, ids, mask, 10, cache=hshare.new_cache(other))  # still patched after the other's calls
    finally:
        hshare.unpatch(other)


# ---- dtype change after patching --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_changed_after_patching(dtype):
    """On CPU the move a user can make is a dtype change (``model.to(dtype)``): the patch stays, the
    cache follows the weights' dtype, and a covering budget is still exact."""
    model = tiny_llama()
    reference = tiny_llama().to(dtype)
    hshare.patch(model, "hshare-1_2-1_2-1_2", **WIDE)
    try:
        model.to(dtype)
        assert hshare.api.patch_state(model) is not None and model.config._attn_implementation == "hshare"
        ids, mask = left_padded([30, 17], torch.Generator().manual_seed(1))
        ref_seq, ref_logits = generate(reference, ids, mask, 8)
        cache = hshare.new_cache(model)
        seq, logits = generate(model, ids, mask, 8, cache=cache)
        assert_same_generation(ref_seq, ref_logits, seq, logits, ids.shape[1], 1e-8 if dtype == torch.float64 else 2e-2)
        hshare.patch(model, "hshare-1_2-1_2-1_2", sink=2, local=4, heavy=6)
        cache = hshare.new_cache(model)
        seq, logits = generate(model, ids, mask, 8, cache=cache)
        assert torch.isfinite(logits).all() and cache.stats.sparse_steps == 7
        assert all(layer.keys.dtype == dtype for layer in cache.layers)
    finally:
        hshare.unpatch(model)


# ---- a budget beyond Mistral's sliding window -------------------------------------------------------
@pytest.mark.parametrize("preset", ["ds", "hshare-1_2-1_2-1_2", "quest", "streaming"])
def test_budget_exceeding_the_sliding_window_is_exact_dense(preset):
    """N_c = 30 > window 16: no row ever has more valid keys than N_c, so every step is dense and
    exact, also for prompts three times the window."""
    model = tiny_mistral(sliding_window=16)
    ids, mask = left_padded([48, 20, 9], torch.Generator().manual_seed(6))
    ref_seq, ref_logits = generate(model, ids, mask, 10)
    overrides = dict(sink=4, local=26, heavy=0) if preset == "streaming" else dict(sink=4, local=6, heavy=20)
    seq, logits, cache = patched_run(model, ids, mask, 10, preset, **overrides)
    assert_same_generation(ref_seq, ref_logits, seq, logits, ids.shape[1], 2e-5)
    stats = cache.stats
    assert stats.sparse_steps == 0 and stats.kv_rows_read == stats.dense_kv_rows
    assert stats.dense_kv_rows == 3 * KV_HEADS * sum(min(16, n + s) for s in range(1, 10) for n in (48, 20, 9))


# ---- a second turn continuing the same cache --------------------------------------------------------
@pytest.mark.parametrize("preset,overrides", [("ds", WIDE), ("hshare-1_2-1_2-1_2", WIDE),
                                              ("hshare-1_2-1_2-1_2", dict(sink=2, local=4, heavy=6))])
def test_second_turn_continues_the_cache(preset, overrides):
    """generate, append a user turn of several tokens, generate again on the same cache: the second
    prefill runs on a non-empty cache (labels appended, plan and selections redone). Exact with a
    covering budget; sparse and finite with a small one."""
    from transformers import DynamicCache

    model = tiny_llama(dtype=torch.float64)
    ids, mask = left_padded([30, 17], torch.Generator().manual_seed(0))
    turn = tokens(14, seed=4).reshape(2, 7)

    def two_turns(cache):
        first = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                               pad_token_id=0, **cache_kwarg(cache), suppress_tokens=[0])
        ids2 = torch.cat((first, turn), 1)
        mask2 = torch.cat((mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=torch.long)), 1)
        out = model.generate(ids2, attention_mask=mask2, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0, **cache_kwarg(cache), output_logits=True, return_dict_in_generate=True,
                             suppress_tokens=[0])
        return out.sequences, torch.stack(out.logits, 1), ids2.shape[1]

    ref_seq, ref_logits, width = two_turns(DynamicCache(config=model.config))
    with hshare.patched(model, preset, prefix="off", **overrides):
        cache = hshare.new_cache(model)
        seq, logits, _ = two_turns(cache)
    assert torch.isfinite(logits).all() and cache.stats.decode_steps == 4 + 5
    if overrides is WIDE:
        assert_same_generation(ref_seq, ref_logits, seq, logits, width, 1e-8)
    else:
        assert cache.stats.sparse_steps == 9


def test_invalid_budget_is_refused_naming_the_field():
    """The edge of validation: a budget with no local window cannot hold the current token."""
    with pytest.raises(ConfigError, match="HShareConfig.budget.local"):
        hshare.patch(tiny_llama(), "ds", local=0)


# ---- a model split over devices (accelerate's device_map) -------------------------------------------
def test_sparse_presets_refuse_a_model_split_over_devices():
    """Sparse decode of a device_map split is not supported yet: refused by name at patch time, and at
    generate time for a model dispatched after patching; dense is accepted."""
    model = tiny_llama()
    split = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    model.hf_device_map = split
    with pytest.raises(ValueError, match=r"split over devices \['0', '1'\].*accepted: the 'dense' preset"):
        hshare.patch(model, "ds")
    assert hshare.api.patch_state(model) is None
    hshare.patch(model, "dense")  # exact dense is accepted
    hshare.unpatch(model)
    del model.hf_device_map
    ids, mask = left_padded([12, 9])
    with hshare.patched(model, "ds", **WIDE):
        model.hf_device_map = split  # dispatched after patching
        with pytest.raises(ValueError, match="split over devices"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
    del model.hf_device_map
