"""Architectures beyond Llama/Mistral pass Llama's exactness tests; models whose attention hshare
does not compute are refused by name, with the reason, before anything is patched.

Adding a built-in architecture (`hshare.patches`): one row in `MODELS`."""

import pytest
import torch
from transformers import (DynamicCache, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          GemmaConfig, GemmaForCausalLM, GptOssConfig, GptOssForCausalLM, GraniteConfig,
                          GraniteForCausalLM, MixtralConfig, MixtralForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                          OlmoConfig, OlmoForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM, Starcoder2Config, Starcoder2ForCausalLM)

import hshare
from hshare.patches import ADAPTERS, ArchitectureAdapter, UnsupportedModelError, register
from hshare.selection import NO_TOKEN

from conftest import (VOCAB, WIDE, assert_rows_equal_alone, cache_kwarg, generate_with_logits, greedy, left_pad,
                      left_padded, randomize_zeroed_weights)

SMALL = dict(sink=2, local=4, heavy=6)  # N_c = 12, far below the prompts used here
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=24, max_window_layers=0)  # every layer slides
MODELS = {  # model type: (config class, model class, layers, config, config with one window in every layer)
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, 4, {}, QWEN_WINDOW),  # q/k/v bias
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, 3, {}, QWEN_WINDOW),  # q/k RMSNorm per head, before RoPE
    "gemma": (GemmaConfig, GemmaForCausalLM, 2, {}, None),  # scaled embeddings, GeGLU
    "granite": (GraniteConfig, GraniteForCausalLM, 2, dict(attention_multiplier=0.4), None),  # softmax scale
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, 2, {}, None),  # q/k RMSNorm over all heads, before RoPE
    "phi3": (Phi3Config, Phi3ForCausalLM, 2, {}, dict(sliding_window=24)),  # fused qkv projection
    "starcoder2": (Starcoder2Config, Starcoder2ForCausalLM, 2, {}, dict(sliding_window=24)),  # biases, LayerNorm
    # mixtures of experts: top-2 of 4 experts after attention (the eager experts: grouped_mm has no float64)
    "mixtral": (MixtralConfig, MixtralForCausalLM, 2, dict(num_local_experts=4, num_experts_per_tok=2,
                experts_implementation="eager"), dict(sliding_window=24)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, 2, dict(num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=64, experts_implementation="eager"),
                  dict(use_sliding_window=True, sliding_window=24, layer_types=["sliding_attention"] * 2)),
    # + a gated shared expert; its stock windows alternate by layer (refused by hshare.patches.features)
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, 2, dict(num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, experts_implementation="eager"), QWEN_WINDOW),
}
WINDOWED = sorted(name for name, row in MODELS.items() if row[4] is not None)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls gain nothing from a second thread, and on a 2-core machine shared with other
    processes two OpenMP threads spin against them (this file, measured so: 12 s with one, 146 s with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(model_type, dtype=torch.float32, seed=0, windowed=False, **config):
    config_class, model_class, layers, defaults, window = MODELS[model_type]
    torch.manual_seed(seed)
    config = {**SHAPE, "num_hidden_layers": layers, **defaults, **(window if windowed else {}), **config}
    return randomize_zeroed_weights(model_class(config_class(**config)).to(dtype).eval())


def assert_same(got, ref):
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


@pytest.fixture(params=sorted(MODELS))
def model_type(request):
    return request.param


def test_every_built_in_architecture_is_tested():
    assert set(ADAPTERS) == set(MODELS) | {"llama", "mistral"}  # those two: tests/test_generate.py


# ---- exactness (Llama's tests, on each architecture) ------------------------------------------
@pytest.mark.parametrize("preset,overrides", [("dense", {}), ("ds", WIDE), ("hshare-1_2-1_2-1_2", WIDE),
                                              ("streaming", dict(sink=2, local=400))])
def test_budget_covering_context_equals_unpatched(model_type, preset, overrides):
    model = tiny(model_type)
    ids, mask = left_padded([37, 20, 29], torch.Generator().manual_seed(11))
    ref = generate_with_logits(model, ids, mask)
    with hshare.patched(model, preset, **overrides):
        assert_same(generate_with_logits(model, ids, mask), ref)


@pytest.mark.parametrize("preset,overrides", [
    ("ds", SMALL), ("hshare-1_2-1_2-1_2", {**SMALL, "plan_scope": "sample"}), ("streaming", dict(sink=2, local=10)),
])
def test_padded_rows_equal_rows_alone(model_type, preset, overrides):
    model = tiny(model_type, dtype=torch.float64)
    lengths = [30, 45, 11]
    ids, mask = left_padded(lengths, torch.Generator().manual_seed(12))
    with hshare.patched(model, preset, **overrides):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=6, **cache_kwarg(cache))
        assert cache.stats.sparse_steps == 5  # really sparse: N_c = 12 is below the rows' contexts
        assert_rows_equal_alone(model, ids, mask, lengths, new_tokens=12)


def test_shared_prefix_equals_unpatched(model_type):
    model = tiny(model_type)
    gen = torch.Generator().manual_seed(13)
    prefix = torch.randint(3, VOCAB, (30,), generator=gen)
    ids, mask = left_pad([torch.cat((prefix, torch.randint(3, VOCAB, (n,), generator=gen))) for n in (5, 12, 1)])
    ref = generate_with_logits(model, ids, mask, new_tokens=8)
    with hshare.patched(model, "dense", prefix="on"):
        cache = hshare.new_cache(model)
        assert_same(generate_with_logits(model, ids, mask, new_tokens=8, **cache_kwarg(cache)), ref)
    assert [level.width for level in cache.prefix.levels] == [30]


def test_unpatch_restores_identical_outputs(model_type):
    model = tiny(model_type)
    ids, mask = left_padded([33, 26], torch.Generator().manual_seed(14))
    ref = generate_with_logits(model, ids, mask, new_tokens=6)
    hshare.patch(model, "hshare-1_2-1_2-1_2", **SMALL)
    assert not torch.equal(generate_with_logits(model, ids, mask, new_tokens=6)[1], ref[1])
    hshare.unpatch(model)
    assert "generate" not in model.__dict__ and model.config._attn_implementation == "sdpa"
    got = generate_with_logits(model, ids, mask, new_tokens=6)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_cached_keys_are_the_models_keys(model_type):
    """hshare caches (and scores) what transformers' own cache holds: biased (Qwen2, StarCoder2) or
    normed (Qwen3, OLMo 2) and rotated keys; the attention function adds nothing."""
    model = tiny(model_type)
    ids, mask = left_padded([19, 12], torch.Generator().manual_seed(15))
    reference = DynamicCache(config=model.config)
    model(ids, attention_mask=mask, **cache_kwarg(reference))
    with hshare.patched(model, "ds", **SMALL):
        cache = hshare.new_cache(model)
        model(ids, attention_mask=mask, **cache_kwarg(cache))
    for ours, theirs in zip(cache.layers, reference.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("model_type", WINDOWED)
def test_one_sliding_window_in_every_layer_is_respected(model_type):
    """One window in every layer (Qwen: use_sliding_window with max_window_layers=0), as Mistral's."""
    model = tiny(model_type, windowed=True)
    assert set(getattr(model.config, "layer_types", None) or ["sliding_attention"]) == {"sliding_attention"}
    ids, mask = left_padded([50, 36], torch.Generator().manual_seed(16))
    ref = generate_with_logits(model, ids, mask, new_tokens=8)
    for preset, overrides in (("dense", {}), ("ds", dict(sink=2, local=4, heavy=30))):  # N_c 36 >= window
        with hshare.patched(model, preset, **overrides):
            assert_same(generate_with_logits(model, ids, mask, new_tokens=8), ref)
    with hshare.patched(model, "hshare-1_2-1_2-1_2", sink=2, local=3, heavy=5):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=8, **cache_kwarg(cache))
    windows = cache.planner.current.windows
    assert windows.n_valid.tolist() == [24, 24]
    for layer in cache.layers:
        chosen = windows.critical_indices(layer.heavy)
        rows = torch.arange(len(ids))[:, None, None].expand_as(chosen)[chosen != NO_TOKEN]
        assert bool(windows.valid[rows, chosen[chosen != NO_TOKEN]].all()), "a token outside the window was selected"


# ---- refusals -----------------------------------------------------------------------------------
def _gemma2(**config):
    return Gemma2ForCausalLM(Gemma2Config(**{**SHAPE, "num_hidden_layers": 2, "sliding_window": 8, **config}))


def _gemma3():
    return Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, num_hidden_layers=2, sliding_window=8,
                                              sliding_window_pattern=2))


def _gpt_oss(**config):
    return GptOssForCausalLM(GptOssConfig(**{**SHAPE, "num_hidden_layers": 2, "num_local_experts": 2,
                                             "num_experts_per_tok": 1, "sliding_window": 8, **config}))


@pytest.mark.parametrize("build,model_type,feature,evidence,accepted", [
    (_gemma2, "gemma2", "attention logit soft-capping", "attn_logit_softcapping=50.0", "attn_logit_softcapping=None"),
    (lambda: _gemma2(attn_logit_softcapping=None), "gemma2", "alternating sliding windows",
     "sliding_attention (layers 0)", "every layer 'full_attention'"),
    (_gemma3, "gemma3_text", "alternating sliding windows", "full_attention (layers 1)", "max_window_layers=0"),
    (lambda: tiny("qwen2", windowed=True, max_window_layers=2), "qwen2",
     "alternating sliding windows", "full_attention (layers 0, 1), sliding_attention (layers 2, 3)",
     "max_window_layers=0"),
    (lambda: tiny("qwen2_moe", use_sliding_window=True, sliding_window=24, max_window_layers=2), "qwen2_moe",
     "alternating sliding windows", "sliding_attention (layers 0)", "max_window_layers=0"),  # its stock pattern
    (lambda: _gpt_oss(layer_types=["full_attention"] * 2), "gpt_oss", "attention sinks", "GptOssAttention.sinks",
     "without sink"),
    (lambda: tiny("gemma", use_bidirectional_attention=True), "gemma", "bidirectional attention",
     "use_bidirectional_attention=True", "causal attention"),
])
def test_unsupported_attention_is_refused_by_name_before_patching(build, model_type, feature, evidence, accepted):
    model = build()
    implementation = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError) as error:
        hshare.patch(model)
    message = str(error.value)
    for part in (repr(model_type), feature, evidence, "Accepted: ", accepted):
        assert part in message
    assert model.config._attn_implementation == implementation and "generate" not in model.__dict__
    assert hshare.api.patch_state(model) is None


def test_other_models_are_refused_until_registered():
    model = OlmoForCausalLM(OlmoConfig(**SHAPE, num_hidden_layers=2)).eval()
    with pytest.raises(UnsupportedModelError, match=r"'olmo' \(OlmoForCausalLM\): no adapter.*llama, mistral, "
                                                   r"mixtral, olmo2, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe"
                                                   r".*hshare.patches.register"):
        hshare.patch(model)
    try:
        register(ArchitectureAdapter(model_type="olmo", attention_class="OlmoSelfAttention"))
        with pytest.raises(UnsupportedModelError, match="found 0 OlmoSelfAttention modules for 2 layers"):
            hshare.patch(model)
        register(ArchitectureAdapter(model_type="olmo", attention_class="OlmoAttention"))
        ids, mask = left_padded([27, 18], torch.Generator().manual_seed(17))
        ref = generate_with_logits(model, ids, mask, new_tokens=6)
        with hshare.patched(model, "ds", **WIDE):
            assert_same(generate_with_logits(model, ids, mask, new_tokens=6), ref)
    finally:
        ADAPTERS.pop("olmo", None)
