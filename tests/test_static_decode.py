"""Static-shape decode (`hshare.static_decode`) on the CPU: the same step code a CUDA graph
captures, run eagerly on buffers sized once (``STATIC_ON_CPU``). Its tokens and work counters must
equal eager decode's; buffers are sized exactly; what cannot run static says why."""

from __future__ import annotations

import pytest
import torch

import hshare
from hshare import attention, static_decode
from hshare.quest import pages_for
from conftest import VOCAB, cache_kwarg, left_pad, left_padded, tiny_llama, tiny_mistral

SPARSE = dict(sink=2, local=4, heavy=6)


@pytest.fixture(autouse=True)
def _static_on_cpu(monkeypatch):
    monkeypatch.setattr(static_decode, "STATIC_ON_CPU", True)


def _generate(model, ids, mask, new_tokens=8, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          pad_token_id=0, **kwargs)


def _run(model, preset, ids, mask, static: bool, new_tokens=8, seed=None, **overrides):
    """Tokens and cache of one patched generate, static shapes (CUDA graphs on CUDA) on or off."""
    hshare.patch(model, preset, cuda_graphs=static, **overrides)
    cache = hshare.new_cache(model)
    kwargs = {}
    if seed is not None:
        torch.manual_seed(seed)
        kwargs = dict(do_sample=True, top_k=20)
    out = _generate(model, ids, mask, new_tokens, **cache_kwarg(cache), **kwargs)
    hshare.unpatch(model)
    return out, cache


def _same_work(static_cache, eager_cache) -> None:
    ours, theirs = static_cache.stats, eager_cache.stats
    for name in ("decode_steps", "sparse_steps", "dense_fallback_steps", "selection_steps", "score_computations",
                 "plans", "kv_rows_read", "dense_kv_rows"):
        assert getattr(ours, name) == getattr(theirs, name), name
    # static shapes score every reserved column (labels) or page slot (Quest): scorings x reserve
    if static_cache.config.policy.name == "quest":
        assert ours.scored_pages == ours.score_computations * pages_for(static_cache.reserve, static_cache.config.policy.page_size)
    elif static_cache.config.candidate_count:  # refinements score their candidates' label rows besides
        assert ours.refinements == theirs.refinements and ours.scored_tokens > ours.score_computations * static_cache.reserve
    else:
        assert ours.scored_tokens == ours.score_computations * static_cache.reserve


@pytest.mark.parametrize("preset,overrides", [
    ("dense", {}),
    ("ds", SPARSE),
    ("hshare-1_2-1_2-1_2", SPARSE),
    ("hshare-7_8-3_4-1_2", dict(SPARSE, plan_scope="sample")),
    ("hshare-1_2-1_2-1_2", dict(SPARSE, selection="query_head", group_lookahead=True)),
    ("streaming", dict(sink=2, local=6)),
    ("random-1_2-1_2-1_2", SPARSE),
    ("quest", dict(SPARSE, page_size=4)),
    ("quest-1_2-1_2-1_2", dict(SPARSE, page_size=3)),
    ("hshare-1_2-1_2-1_2", dict(SPARSE, planner="auto", share_scorings="1/2", layer_sharing="1/4")),
    ("hshare-auto", SPARSE),  # the C = 4 refinement, auto planner, scoring budget 1/4
])
def test_static_shapes_equal_eager(preset, overrides):
    model = tiny_llama(kv_heads=2, layers=4)
    ids, mask = left_padded([31, 18, 26, 9])
    eager, eager_cache = _run(model, preset, ids, mask, static=False, **overrides)
    static, cache = _run(model, preset, ids, mask, static=True, **overrides)
    assert cache.static_decode.reason == "" and cache.static_decode.eager_steps == 7
    assert cache.static_decode.projections == "stacked"  # each step's q, k and v in one product
    assert torch.equal(static, eager)
    _same_work(cache, eager_cache)
    if preset == "dense":
        assert torch.equal(static, _generate(model, ids, mask))


def test_projections_stacked_for_the_generate_only():
    """During static decode steps q/k/v share one storage per attention; after the generate each parameter
    has its own again, with its values."""
    model = tiny_llama(kv_heads=2, layers=2)
    attention = model.model.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    before = [p.weight.detach().clone() for p in projections]
    storages = []
    attention.register_forward_pre_hook(
        lambda module, args: storages.append(len({p.weight.untyped_storage().data_ptr() for p in projections})))
    ids, mask = left_padded([20, 13])
    _, cache = _run(model, "dense", ids, mask, static=True)
    assert cache.static_decode.projections == "stacked"
    assert storages[0] == 3 and set(storages[1:]) == {1}  # the prefill unstacked, every decode step stacked
    assert len({p.weight.untyped_storage().data_ptr() for p in projections}) == 3
    assert all(torch.equal(p.weight, w) for p, w in zip(projections, before))


def test_projections_unstacked_when_asked():
    model = tiny_llama(kv_heads=2, layers=2)
    weight = model.model.layers[0].self_attn.k_proj.weight.data
    ids, mask = left_padded([20, 13])
    _, cache = _run(model, "dense", ids, mask, static=True, fuse_projections=False)
    assert cache.static_decode.reason == "" and cache.static_decode.projections == "fuse_projections=False"
    assert model.model.layers[0].self_attn.k_proj.weight.data.data_ptr() == weight.data_ptr()


def test_budget_covering_context_and_mha_equal_unpatched():
    model = tiny_llama(kv_heads=4, heads=4)
    ids, mask = left_padded([12, 7])
    reference = _generate(model, ids, mask)
    static, cache = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True, sink=4, local=8, heavy=16)
    assert cache.static_decode.reason == ""
    assert torch.equal(static, reference)


def test_seeded_sampling_equals_eager():
    model = tiny_llama()
    ids, mask = left_padded([30, 21])
    eager, _ = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=False, seed=3, **SPARSE)
    static, _ = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True, seed=3, **SPARSE)
    assert torch.equal(static, eager)


@pytest.mark.parametrize("preset", ["dense", "ds"])
def test_shared_prefix_equals_eager(preset):
    model = tiny_llama()
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, VOCAB, (40,), generator=generator)
    ids, mask = left_pad([torch.cat((prefix, torch.randint(3, VOCAB, (n,), generator=generator))) for n in (6, 3, 9)])
    overrides = dict(prefix="on", **({} if preset == "dense" else SPARSE))
    eager, eager_cache = _run(model, preset, ids, mask, static=False, **overrides)
    static, cache = _run(model, preset, ids, mask, static=True, **overrides)
    assert cache.prefix is not None and cache.static_decode.reason == ""
    assert torch.equal(static, eager)
    _same_work(cache, eager_cache)
    if preset == "dense":
        assert torch.equal(static, _generate(model, ids, mask))


@pytest.mark.parametrize("window", [None, 20])
def test_mistral_equals_unpatched(window):
    model = tiny_mistral(sliding_window=window)
    ids, mask = left_padded([26, 15])
    reference = _generate(model, ids, mask, new_tokens=10)
    static, cache = _run(model, "dense", ids, mask, static=True, new_tokens=10, prefix="off")
    assert cache.static_decode.reason == ""
    assert torch.equal(static, reference)


def test_buffers_are_sized_exactly_once():
    model = tiny_llama(kv_heads=2, layers=3)
    ids, mask = left_padded([22, 15])
    new_tokens = 9
    _, cache = _run(model, "ds", ids, mask, static=True, new_tokens=new_tokens, **SPARSE)
    reserve = ids.shape[1] + new_tokens - 1  # the last token is sampled, not fed back (StaticCache's size too)
    assert cache.reserve == cache.static_decode.reserved == reserve and cache.static_decode.reason == ""
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for layer in cache.layers:
        assert layer.key_buffer.storage.shape == (2, 2, reserve, head_dim)
        assert layer.value_buffer.storage.shape == (2, 2, reserve, head_dim)
        for buffer in layer.policy.buffers:
            assert buffer.capacity == reserve
    # every column written: the last decode step's token sits in the last column, every buffer followed
    assert cache.get_seq_length() == reserve
    assert all(buffer.length == reserve for layer in cache.layers for buffer in layer.buffers)
    with pytest.raises(RuntimeError, match=f"static buffers full: {reserve} \\+ 1 tokens > reserve {reserve}"):
        cache.advance(1)
    kv = 3 * 2 * (2 * 2 * reserve * head_dim * 4)
    labels = sum(b.reserved_bytes() for layer in cache.layers for b in layer.policy.buffers)
    assert cache.reserved_bytes() == kv + labels


@pytest.mark.parametrize("preset,overrides", [("hshare-1_2-1_2-1_2", SPARSE),
                                              ("quest-1_2-1_2-1_2", dict(SPARSE, page_size=4))])
def test_outgrowing_the_reserve_goes_on_eagerly(monkeypatch, preset, overrides):
    model = tiny_llama()
    ids, mask = left_padded([25, 17])
    eager, _ = _run(model, preset, ids, mask, static=False, new_tokens=10, **overrides)
    budget = static_decode.new_token_budget
    monkeypatch.setattr(static_decode, "new_token_budget", lambda *a: budget(*a) - 4)
    import hshare.api as api
    monkeypatch.setattr(api, "new_token_budget", static_decode.new_token_budget)
    static, cache = _run(model, preset, ids, mask, static=True, new_tokens=10, **overrides)
    assert "outgrew its reserved" in cache.static_decode.reason
    assert torch.equal(static, eager)
    assert cache.static is None and cache.own_capacity > cache.reserve  # grew after thawing
    if preset.startswith("quest"):  # the pages went on growing from where the static steps left them
        policy = cache.layers[1].policy
        assert policy.frozen_width is None and policy.length == cache.own_length
        assert policy.pages == pages_for(policy.length, 4)


@pytest.mark.parametrize("outgrow", [False, True])
def test_generation_below_the_dense_fallback_makes_no_labels(monkeypatch, outgrow):
    """A reserve whose final length stays below the dense fallback decodes densely throughout: no label
    is made or written, the tokens are the unpatched model's, also past an outgrown reserve (where the
    length would cross the fallback: with no labels it must stay dense)."""
    model = tiny_llama(kv_heads=2, layers=3)
    ids, mask = left_padded([27, 16])
    new_tokens = 10
    reference = _generate(model, ids, mask, new_tokens=new_tokens)
    if outgrow:
        budget = static_decode.new_token_budget
        monkeypatch.setattr(static_decode, "new_token_budget", lambda *a: budget(*a) - 4)
        import hshare.api as api
        monkeypatch.setattr(api, "new_token_budget", static_decode.new_token_budget)
    reserve = ids.shape[1] + new_tokens - 1 - (4 if outgrow else 0)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    n_c = hshare.HShareConfig.from_preset("hshare-1_2-1_2-1_2").replace(**SPARSE).budget.total
    # what a sparse step at the reserve saves: rows x (columns - N_c) x KV heads x d x float32 x (K, V)
    layer_bytes = 2 * (reserve - n_c) * 2 * head_dim * 4 * 2
    fallback_mib = (layer_bytes + 1) / 2**20  # the reserve's saving is below it, one more column's is not
    static, cache = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True, new_tokens=new_tokens,
                         dense_fallback_mib=fallback_mib, **SPARSE)
    assert cache.planner.dense_throughout is True
    assert all(layer.policy is None for layer in cache.layers)
    stats = cache.stats
    assert stats.sparse_steps == 0 and stats.dense_fallback_steps == stats.decode_steps == new_tokens - 1
    assert torch.equal(static, reference)
    assert ("outgrew its reserved" in cache.static_decode.reason) == outgrow
    # a reserve one column over the fallback makes labels (and the eager path always does)
    _, above = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True, new_tokens=new_tokens,
                    dense_fallback_mib=(layer_bytes - 1) / 2**20, **SPARSE)
    assert above.planner.dense_throughout is False and all(layer.policy is not None for layer in above.layers)


@pytest.mark.parametrize("setup,reason", [
    (dict(preset="ds", overrides=dict(SPARSE, cuda_graphs=False)), "cuda_graphs=False"),
    (dict(preset="ds", overrides=SPARSE, generate=dict(num_beams=2)), "beam search"),
    (dict(preset="dense", overrides={}, generate=dict(output_hidden_states=True, return_dict_in_generate=True)),
     "output_hidden_states"),
    (dict(preset="ds", overrides=SPARSE, model=dict(_tp_size=2)), "tensor parallelism (tp_size=2)"),
])
def test_what_cannot_run_static_says_why(setup, reason):
    model = tiny_llama()
    for name, value in setup.get("model", {}).items():  # what transformers sets on a model it sharded
        setattr(model, name, value)
    ids, mask = left_padded([20, 14])
    hshare.patch(model, setup["preset"], **setup["overrides"])
    cache = hshare.new_cache(model)
    _generate(model, ids, mask, **cache_kwarg(cache), **setup.get("generate", {}))
    hshare.unpatch(model)
    assert reason in cache.static_decode.reason


def test_cache_implementation_static_gets_hshare_cache():
    model = tiny_llama()
    ids, mask = left_padded([20, 13])
    reference = _generate(model, ids, mask)
    hshare.patch(model, "dense", prefix="off")
    seen = []
    original = static_decode.StaticDecoder._decode

    def spy(self, cache, kwargs):
        seen.append(cache)
        return original(self, cache, kwargs)

    static_decode.StaticDecoder._decode = spy
    try:
        out = _generate(model, ids, mask, cache_implementation="static")
        model.generation_config.cache_implementation = "static"
        out_config = _generate(model, ids, mask)
    finally:
        static_decode.StaticDecoder._decode = original
        model.generation_config.cache_implementation = None
    assert torch.equal(out, reference) and torch.equal(out_config, reference)
    assert seen and all(isinstance(c, hshare.HShareCache) for c in seen)
    with pytest.raises(ValueError, match="cache_implementation='offloaded'.*accepted"):
        _generate(model, ids, mask, cache_implementation="offloaded")
    hshare.unpatch(model)


def test_repeated_calls_with_other_shapes_get_fresh_buffers():
    model = tiny_llama()
    small, large = left_padded([20, 9]), left_padded([33, 21, 30])
    hshare.patch(model, "hshare-1_2-1_2-1_2", **SPARSE)
    first = _generate(model, *small, new_tokens=5)
    second = _generate(model, *large, new_tokens=11)
    again = _generate(model, *small, new_tokens=5)
    hshare.patch(model, "hshare-1_2-1_2-1_2", cuda_graphs=False, **SPARSE)
    eager = _generate(model, *large, new_tokens=11)
    hshare.unpatch(model)
    assert torch.equal(first, again) and torch.equal(second, eager)


def _tiny_qwen2(sliding: bool, window: int):
    """A Qwen2 whose config names a window that every layer applies (`sliding`) or none does."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         use_sliding_window=sliding, sliding_window=window, max_window_layers=0, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("sliding", [False, True])
def test_qwen2_window_only_where_layers_slide(sliding):
    model = _tiny_qwen2(sliding, window=16)
    ids, mask = left_padded([24, 13])
    reference = _generate(model, ids, mask, new_tokens=6)
    static, cache = _run(model, "dense", ids, mask, static=True, new_tokens=6, prefix="off")
    assert cache.static_decode.reason == ""
    assert torch.equal(static, reference)


@pytest.mark.parametrize("sliding", [False, True])
def test_shared_prefix_declined_only_where_a_window_applies(sliding):
    """A Qwen2 config names a window its layers do not apply (``use_sliding_window=False``): the shared
    prefix is held once past that length; with the window applied it is declined (the prefix must stay
    inside every row's window). Tokens are the unpatched model's either way."""
    model = _tiny_qwen2(sliding, window=24)
    prefix = torch.randint(3, VOCAB, (20,))
    ids, mask = left_pad([torch.cat((prefix, torch.randint(3, VOCAB, (n,)))) for n in (5, 2, 7)])
    reference = _generate(model, ids, mask, new_tokens=8)  # 27 + 8 tokens: past the window
    out, cache = _run(model, "dense", ids, mask, static=False, new_tokens=8, prefix="on")
    assert (cache.prefix is not None and bool(cache.prefix.levels)) == (not sliding)
    assert torch.equal(out, reference)


def test_warm_signature_is_the_shapes_not_the_data():
    """Two generates of the same shapes with other prompts (so other greedy plans) have one warm signature
    per kind: the second captures without an eager warm-up on CUDA. Other lengths, rows, configs or kinds
    have another."""
    model = tiny_llama(kv_heads=2, layers=4)
    torch.manual_seed(0)

    def signature(lengths, kind="select", **overrides):
        ids, mask = left_padded(lengths)
        _, cache = _run(model, "hshare-1_2-1_2-1_2", ids, mask, static=True,
                        **dict(SPARSE, dense_fallback_mib=0, **overrides))
        assert cache.static_decode.reason == "" and cache.planner.shares
        plan = cache.planner.sharing
        return static_decode.warm_signature(cache, kind), (plan.layer_source.tolist(), plan.head_source.tolist())

    first, first_plan = signature([30, 22, 27])
    plans = set()
    for _ in range(4):  # other prompts: plans differ in which layers select, not in the shapes of their work
        other, plan = signature([30, 22, 27])
        plans.add(repr(plan))
        assert other == first
    assert len(plans | {repr(first_plan)}) > 1
    assert signature([30, 22, 27], kind="reuse")[0] != first
    assert signature([31, 22, 27])[0] != first  # one more reserved column
    assert signature([30, 22])[0] != first  # fewer rows
    assert signature([30, 22, 27], heavy=8)[0] != first


def test_label_cache_freezes_whole_at_its_reserve():
    """`LabelCache.freeze` exposes the whole reserved label buffers (`SelectionPolicy.freeze`, as Quest's
    pages), refuses a width beyond its reserve, and `thaw` returns to the written columns."""
    from hshare.labels import LabelCache

    keys = torch.randn(2, 2, 6, 8)
    store = LabelCache(torch.stack([torch.randperm(8)[:4] for _ in range(2)])[None], 4, kv_heads=2, reserve=10)
    store.append(keys)
    with pytest.raises(RuntimeError, match="labels reserved for 10 columns, static decode needs 12"):
        store.freeze(12)
    store.freeze(10)
    assert all(buffer.view().shape[2] == 10 for buffer in store.buffers)
    store.thaw(6)
    assert all(buffer.view().shape[2] == 6 for buffer in store.buffers) and store.length == 6


@pytest.mark.parametrize("preset,kernels,overrides", [
    ("hshare-refine-successors-c4", "triton", {}),  # the walk writes every head's entries, the copying heads refine
    ("hshare-refine-successors-c4", "triton", dict(head_sharing=1)),  # every head selects: the walk's own results
    ("hshare-refine-successors-c4", "torch", {}),
    ("hshare-1_2-1_2-1_2", "torch", {}),  # the head gathers write into the buffer, copying layers keep the source's
    ("hshare-successors", "triton", {}),
    ("ds", "triton", {}),  # every head selects: the fused label top-k writes into the buffer
    ("ds", "torch", {}),
    ("quest", "triton", {}),  # the page top-k writes into the buffer
])
def test_selection_writes_the_kept_buffers(monkeypatch, preset, kernels, overrides):
    """With static shapes a selection step's layers write their heavy columns (and candidates) into the layer's
    kept buffers from the first selection step on, or keep their source layer's: no step copies them there (a step
    captured before any eager one, its signature warmed by an earlier generate, would replay such a copy every
    time). The tokens equal eager decode's."""
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    calls = []

    def keep(cache, layer, name, columns):
        calls.append((name, getattr(layer, name) is columns))
        return keep_columns(cache, layer, name, columns)

    keep_columns = attention._keep
    model = tiny_llama(kv_heads=4, heads=4, layers=2)
    ids, mask = left_padded([21, 14, 9])
    options = dict(SPARSE, **overrides)
    eager, _ = _run(model, preset, ids, mask, static=False, new_tokens=5, **options)
    monkeypatch.setattr(attention, "_keep", keep)
    static, cache = _run(model, preset, ids, mask, static=True, new_tokens=5, **options)
    assert cache.static_decode.reason == ""
    assert {name for name, _ in calls} == ({"heavy", "candidates"} if cache.config.candidate_count else {"heavy"})
    assert all(in_place for _, in_place in calls), calls
    assert torch.equal(static, eager)
