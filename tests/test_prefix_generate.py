"""Shared-prefix detection, layout and ``generate`` with the prefix held once (tiny random models)."""

import pytest
import torch

import hshare
from hshare import compat
from hshare.prefix import build_layout, detect_shared_prefix
from hshare.selection import NO_TOKEN

from conftest import VOCAB, cache_kwarg, left_pad, tiny_llama, tiny_mistral


def tokens(n, generator=None):
    return torch.randint(3, VOCAB, (n,), generator=generator)



def run(model, ids, mask, new_tokens=8, cache=None, **kwargs):
    kwargs.setdefault("do_sample", False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True, **cache_kwarg(cache),
                         **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


def compare_with_unpatched(model, ids, mask, preset="dense", new_tokens=8, expect_levels=None, **kwargs):
    """Tokens identical and teacher-forced logits within fp32 rounding; returns the cache."""
    seed = kwargs.pop("seed", 0)
    torch.manual_seed(seed)
    ref_tokens, ref_logits = run(model, ids, mask, new_tokens, **kwargs)
    with hshare.patched(model, preset, prefix="on"):
        cache = hshare.new_cache(model)
        torch.manual_seed(seed)
        got_tokens, got_logits = run(model, ids, mask, new_tokens, cache=cache, **kwargs)
    assert torch.equal(got_tokens, ref_tokens)
    torch.testing.assert_close(got_logits, ref_logits, rtol=1e-5, atol=1e-5)
    if expect_levels is not None:
        assert cache.prefix is not None and [lv.width for lv in cache.prefix.levels] == expect_levels
    return cache


# ---- detection and layout ---------------------------------------------------------------------
def test_detection_hand_worked():
    t = torch.tensor
    prompts = [t([5, 6, 7, 8, 9]), t([5, 6, 7, 3]), t([5, 6, 7, 8, 9, 4]), t([5, 6, 7, 3, 1])]
    shared = detect_shared_prefix(prompts, min_tokens=1, min_rows=1, levels=2)
    assert shared.common == 3
    # rows 0 and 2 share [8, 9] beyond the common prefix (row 0 keeps its last token: extension 1);
    # rows 1 and 3 share [3] but row 1 must keep it as its own token: no group
    assert shared.groups == [([0, 2], 1)]
    # 4 tokens: no common prefix that long, but rows 0 and 2 share 4 (a level of its own)
    assert detect_shared_prefix(prompts, min_tokens=4, min_rows=1, levels=2) == type(shared)(0, [([0, 2], 4)])
    assert detect_shared_prefix(prompts, min_tokens=5, min_rows=1, levels=2).empty
    assert detect_shared_prefix(prompts, min_tokens=1, min_rows=5, levels=1).empty
    same = [t([4, 4, 4, 4])] * 3
    assert detect_shared_prefix(same, 1, 1, 2).common == 3  # whole prompt but its last token
    # token reads saved per step: (3 rows - 1) x 3 = 6
    assert detect_shared_prefix(same, 1, 1, 2, min_saved=6).common == 3
    assert detect_shared_prefix(same, 1, 1, 2, min_saved=7).empty


def test_layout_keeps_positions_and_tokens():
    gen = torch.Generator().manual_seed(0)
    few_shot = tokens(6, gen)
    questions = [tokens(5, gen), tokens(3, gen)]
    prompts = [torch.cat((few_shot, questions[q], tokens(n, gen))) for q, n in ((0, 2), (1, 4), (0, 1), (1, 1))]
    shared = detect_shared_prefix(prompts, 1, 1, 2)
    layout = build_layout(prompts, shared, pad_token_id=0)
    assert layout.widths[0] == 6 and sorted(rows for rows, _ in shared.groups) == [[0, 2], [1, 3]]
    positions = layout.attention_mask.cumsum(-1) - 1
    for row, prompt in enumerate(prompts):
        kept = layout.attention_mask[row].bool()
        assert torch.equal(layout.input_ids[row, kept], prompt)  # same tokens in order
        assert torch.equal(positions[row, kept], torch.arange(len(prompt)))  # same RoPE positions
        assert layout.attention_mask[row, -1] == 1  # every row has an own token


# ---- generate: dense config equals the unpatched model ----------------------------------------
@pytest.mark.parametrize("kv_heads", [2, 4, 1])
def test_left_padded_shared_prefix(kv_heads):
    model = tiny_llama(kv_heads=kv_heads)
    prefix = tokens(40)
    prompts = [torch.cat((prefix, tokens(n))) for n in (5, 17, 1, 9)]
    compare_with_unpatched(model, *left_pad(prompts), expect_levels=[40])


def test_mistral_shared_prefix_and_window_fallback():
    prefix = tokens(30)
    prompts = [torch.cat((prefix, tokens(n))) for n in (3, 8)]
    cache = compare_with_unpatched(tiny_mistral(sliding_window=None), *left_pad(prompts), expect_levels=[30])
    assert cache.prefix is not None
    cache = compare_with_unpatched(tiny_mistral(sliding_window=24), *left_pad(prompts))
    assert cache.prefix is None  # the prefix would leave the window: ordinary path


def test_a_window_counts_the_callers_columns_too():
    """A sliding window counts columns. Two rows of one 34-token prompt and 8 new tokens in a window of 43
    columns: laid out compactly they fit (42), so the prefix is shared; when row 1 carries a gap of 6 masked
    columns after its first token (row 0 left-padded by as many), the unpatched model drops that first token
    from row 1's window at the last steps, so the prefix must not be shared there (the ordinary path, equal to
    the unpatched model)."""
    prompt = torch.cat((tokens(30), tokens(4)))
    model = tiny_mistral(sliding_window=43)
    ids, mask = left_pad([prompt, prompt])
    compare_with_unpatched(model, ids, mask, expect_levels=[33])  # the whole prompt but each row's last token
    gap = torch.zeros(6, dtype=prompt.dtype)
    ids = torch.stack((torch.cat((gap, prompt)), torch.cat((prompt[:1], gap, prompt[1:]))))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    mask[1, 1:7] = 0
    cache = compare_with_unpatched(model, ids, mask)
    assert cache.prefix is None


def test_two_levels_rows_not_contiguous():
    model = tiny_llama()
    few_shot, q1, q2 = tokens(20), tokens(12), tokens(7)
    prompts = [torch.cat(p) for p in ((few_shot, q1, tokens(2)), (few_shot, q2, tokens(5)), (few_shot, tokens(3)),
                                      (few_shot, q1, tokens(4)), (few_shot, q2))]
    cache = compare_with_unpatched(model, *left_pad(prompts), new_tokens=6)
    level1, level2 = cache.prefix.levels
    assert level1.width == 20 and level2.groups == 2
    group = level2.row_group.tolist()
    assert group[0] == group[3] != group[1] == group[4] and group[2] == -1 and min(group[0], group[1]) == 0


def test_num_return_sequences_whole_prompt_shared():
    model = tiny_llama(dtype=torch.float64)
    ids, mask = left_pad([tokens(25), tokens(14)])
    cache = compare_with_unpatched(model, ids, mask, do_sample=True, num_return_sequences=3, seed=3,
                                   top_k=0, temperature=1.0)
    level2 = cache.prefix.levels[-1]
    assert level2.row_group.tolist() == [0, 0, 0, 1, 1, 1]  # each prompt but its last token, held once


@pytest.mark.parametrize("case", ["no_prefix", "whole_prompt", "batch_of_one"])
def test_edge_cases(case):
    model = tiny_llama()
    if case == "no_prefix":
        prompts = [tokens(9), tokens(13)]
    elif case == "whole_prompt":
        prompts = [tokens(16)] * 3
    else:
        prompts = [tokens(16)]
    cache = compare_with_unpatched(model, *left_pad(prompts))
    if case == "no_prefix":
        assert cache.prefix is None or cache.prefix.levels[0].width < 3
    else:
        assert cache.prefix.width == 15


def test_prefix_length_changes_between_calls():
    model = tiny_llama()
    for length in (33, 12, 50):
        prefix = tokens(length)
        prompts = [torch.cat((prefix, tokens(n))) for n in (4, 2, 7)]
        compare_with_unpatched(model, *left_pad(prompts), new_tokens=5, expect_levels=[length])


def test_beams_and_streamers_fall_back():
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value.clone())

        def end(self):
            pass

    model = tiny_llama()
    prefix = tokens(20)
    ids, mask = left_pad([torch.cat((prefix, tokens(3)))])
    cache = compare_with_unpatched(model, ids, mask, new_tokens=4, num_beams=2)
    assert cache.prefix is None
    streamer = Recorder()
    cache = compare_with_unpatched(model, ids, mask, new_tokens=4, streamer=streamer)
    assert cache.prefix is None and torch.equal(streamer.seen[-5][0], ids[0])  # the prompt as given


def test_continuing_from_a_shared_prefix_cache_is_refused():
    model = tiny_llama()
    prefix = tokens(20)
    ids, mask = left_pad([torch.cat((prefix, tokens(3))), torch.cat((prefix, tokens(6)))])
    with hshare.patched(model, "dense", prefix="on"):
        cache = hshare.new_cache(model)
        out, _ = run(model, ids, mask, cache=cache)
        with pytest.raises(ValueError, match="shared-prefix layout"):
            model.generate(out, attention_mask=torch.ones_like(out), max_new_tokens=2, **cache_kwarg(cache),
                           pad_token_id=0)


def test_auto_mode_thresholds():
    model = tiny_llama()
    prefix = tokens(40)
    ids, mask = left_pad([torch.cat((prefix, tokens(n))) for n in (4, 2)])
    with hshare.patched(model, "dense", prefix_min_tokens=40):  # saves 40 token reads per step: too few
        cache = hshare.new_cache(model)
        run(model, ids, mask, cache=cache)
        assert cache.prefix is None
    with hshare.patched(model, "dense", prefix_min_tokens=41, prefix_min_saved_tokens=0):
        cache = hshare.new_cache(model)
        run(model, ids, mask, cache=cache)
        assert cache.prefix is None
    with hshare.patched(model, "dense", prefix_min_tokens=40, prefix_min_batch=2, prefix_min_saved_tokens=40):
        cache = hshare.new_cache(model)
        run(model, ids, mask, cache=cache)
        assert cache.prefix.width == 40
    with hshare.patched(model, "dense", prefix="off"):
        cache = hshare.new_cache(model)
        run(model, ids, mask, cache=cache)
        assert cache.prefix is None


@pytest.mark.parametrize("graphs", [True, False])
def test_auto_rule_asks_for_the_saved_reads_of_how_steps_run(monkeypatch, graphs):
    """`prefix="auto"` takes its saved-reads threshold for the device and for whether this generate's decode
    steps replay as CUDA graphs (static decode on): the graphs' threshold shares a prefix the eager one does
    not."""
    from hshare import config as config_module, static_decode

    monkeypatch.setattr(static_decode, "STATIC_ON_CPU", True)
    asked = []
    real = config_module.PrefixConfig.min_saved

    def min_saved(self, device, graphs_arg):
        asked.append((device.type, graphs_arg))
        return 40 if graphs_arg else real(self, device, graphs_arg)  # as a CUDA device would answer, on the CPU

    monkeypatch.setattr(config_module.PrefixConfig, "min_saved", min_saved)
    model = tiny_llama()
    prefix = tokens(40)
    ids, mask = left_pad([torch.cat((prefix, tokens(n))) for n in (4, 2)])  # saves 40 reads a step
    with hshare.patched(model, "dense", prefix_min_tokens=40, cuda_graphs=graphs):
        cache = hshare.new_cache(model)
        run(model, ids, mask, cache=cache)
    assert asked == [("cpu", graphs)]
    assert (cache.prefix is not None) == graphs


# ---- sparse config ----------------------------------------------------------------------------
@pytest.mark.parametrize("preset,overrides", [("ds", {}), ("hshare-1_2-1_2-1_2", {"plan_scope": "sample"})])
def test_sparse_own_part_selection_independent_of_sharing(monkeypatch, preset, overrides):
    """Rows decoded together with their prefix stored once select the same own-part tokens as each
    row decoded alone with the prefix split at the same point."""
    model = tiny_llama(dtype=torch.float64)
    prefix = tokens(30)
    prompts = [torch.cat((prefix, tokens(n))) for n in (26, 40, 33)]
    ids, mask = left_pad(prompts)
    config = dict(sink=2, local=4, heavy=6, prefix="on", **overrides)
    with hshare.patched(model, preset, **config):
        cache = hshare.new_cache(model)
        batch_tokens, _ = run(model, ids, mask, new_tokens=9, cache=cache)
        assert cache.prefix.width == 30 and cache.stats.sparse_steps > 0
        own_width = cache.layers[0].key_buffer.length
        batch_heavy = {i: cache.layers[i].heavy for i in cache.sparse_layers}

        import hshare.shared_generate as shared_generate
        real_detect = shared_generate.detect_shared_prefix
        monkeypatch.setattr(shared_generate, "detect_shared_prefix",
                            lambda p, *a: real_detect(p, *a).__class__(30, []))
        for row, prompt in enumerate(prompts):
            alone = hshare.new_cache(model)
            row_tokens, _ = run(model, prompt[None], torch.ones(1, len(prompt), dtype=torch.long), new_tokens=9,
                                cache=alone)
            assert torch.equal(row_tokens[0, len(prompt):], batch_tokens[row, ids.shape[1]:])
            offset = own_width - alone.layers[0].key_buffer.length  # the gap before this row's own part
            for layer, heavy in batch_heavy.items():
                mine = heavy[row]
                shifted = torch.where(mine >= 0, mine - offset, torch.full_like(mine, NO_TOKEN))
                assert torch.equal(shifted.sort(-1).values, alone.layers[layer].heavy[0].sort(-1).values)


def test_sparse_budget_covering_own_part_equals_unpatched():
    model = tiny_llama()
    prefix = tokens(50)
    ids, mask = left_pad([torch.cat((prefix, tokens(n))) for n in (6, 11)])
    compare_with_unpatched(model, ids, mask, preset="ds", expect_levels=[50])


def test_auto_sparse_config_shares_under_the_same_rule():
    model = tiny_llama()
    prefix = tokens(200)
    ids, mask = left_pad([torch.cat((prefix, tokens(n))) for n in (6, 11)])
    for preset in ("ds", "dense"):
        with hshare.patched(model, preset, prefix_min_tokens=16, prefix_min_saved_tokens=200):
            cache = hshare.new_cache(model)
            run(model, ids, mask, cache=cache)
        assert cache.prefix.width == 200
        with hshare.patched(model, preset, prefix_min_tokens=16, prefix_min_saved_tokens=201):
            cache = hshare.new_cache(model)
            run(model, ids, mask, cache=cache)
        assert cache.prefix is None


# ---- memory -----------------------------------------------------------------------------------
def test_prefix_held_once_bytes():
    model = tiny_llama()
    prefix = tokens(120)
    samples, new_tokens = 16, 6
    ids, mask = left_pad([torch.cat((prefix, tokens(3)))])
    with hshare.patched(model, "dense", prefix="on"):
        cache = hshare.new_cache(model)
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=True, num_return_sequences=samples, pad_token_id=0, **cache_kwarg(cache))
    layers, kv_heads, dim = 4, 2, 16
    token_bytes = layers * 2 * kv_heads * dim * 4  # K and V, fp32
    prefix_len = 122  # the whole prompt but its last token
    own = 1 + new_tokens - 1  # last prompt token + generated tokens but the last (never cached)
    assert cache.kv_bytes() == (prefix_len + samples * own) * token_bytes
    assert cache.unshared_kv_bytes() == samples * (prefix_len + own) * token_bytes
    plain = compat.output_cache(model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                               min_new_tokens=new_tokens, do_sample=True, num_return_sequences=samples,
                                               pad_token_id=0, return_dict_in_generate=True))
    plain_bytes = sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in plain.layers)
    assert plain_bytes == cache.unshared_kv_bytes()
