"""Work counters (`DecodeStats`): scorings, scored tokens / pages, K/V rows read, against brute force."""

import dataclasses

import pytest
import torch

import hshare
import hshare.attention as attention_module
from hshare.quest import pages_for
from hshare.selection import valid_columns_from_mask

from conftest import cache_kwarg, greedy, left_pad, left_padded, tiny_llama, tiny_mistral

SMALL = dict(sink=2, local=4, heavy=6)  # N_c = 12
LENGTHS = [40, 27, 51]
NEW = 10
STEPS = NEW - 1  # the first new token comes from the prefill
LAYERS, KV_HEADS, Q_HEADS = 4, 2, 4


def run(model, preset, lengths=LENGTHS, new_tokens=NEW, **overrides):
    ids, mask = left_padded(lengths, torch.Generator().manual_seed(1))
    with hshare.patched(model, preset, **overrides):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=new_tokens, **cache_kwarg(cache))
    return cache.stats


def dense_rows(lengths=LENGTHS, steps=STEPS, layers=LAYERS, kv_heads=KV_HEADS):
    """Every row's valid keys at every decode step (prompt + s tokens), x Hkv x layers."""
    return layers * kv_heads * sum(length + s for s in range(1, steps + 1) for length in lengths)


def test_dense_reads_every_valid_key():
    stats = run(tiny_llama(), "dense")
    assert stats.kv_rows_read == stats.dense_kv_rows == dense_rows()
    assert stats.scored_tokens == stats.scored_pages == stats.score_computations == 0


@pytest.mark.parametrize("selection,heads", [("kv_head", KV_HEADS), ("query_head", Q_HEADS)])
def test_ds_reads_the_budget_and_scores_every_column(selection, heads):
    stats = run(tiny_llama(), "ds", selection=selection, **SMALL)
    width = max(LENGTHS)
    assert stats.dense_kv_rows == dense_rows()
    # every row is longer than N_c = 12 at every step: N_c rows per selection head, every layer
    assert stats.kv_rows_read == LAYERS * heads * 12 * len(LENGTHS) * STEPS
    assert stats.score_computations == LAYERS * heads * len(LENGTHS) * STEPS
    # a scoring scores every cached column (padding included): width + s at step s
    assert stats.scored_tokens == LAYERS * heads * len(LENGTHS) * sum(width + s for s in range(1, STEPS + 1))
    assert stats.scored_pages == 0


def test_dense_layers_read_densely():
    stats = run(tiny_llama(), "ds", dense_layers=[0, 2], **SMALL)
    assert stats.kv_rows_read == dense_rows(layers=2) + 2 * KV_HEADS * 12 * len(LENGTHS) * STEPS


def test_short_rows_are_read_whole():
    stats = run(tiny_llama(), "ds", lengths=[5, 9, 30], new_tokens=6, sink=2, local=4, heavy=10)  # N_c = 16
    expected = LAYERS * KV_HEADS * sum(min(16, n + s) for s in range(1, 6) for n in (5, 9, 30))
    assert stats.kv_rows_read == expected
    assert stats.dense_kv_rows == dense_rows([5, 9, 30], 5)


@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
def test_sharing_preset_scorings_follow_the_ratios(selection):
    """1/2-1/2-1/2: 2 of 4 layers, half the heads, every second step score (with no group lookahead
    every step reads N_c per head: the heavy tokens stay in the middle window)."""
    heads = KV_HEADS if selection == "kv_head" else Q_HEADS
    stats = run(tiny_llama(), "hshare-1_2-1_2-1_2", selection=selection, group_lookahead=False, **SMALL)
    selection_steps = [1, 3, 5, 7, 9]
    per_step = 2 * (heads // 2) * len(LENGTHS)
    assert stats.score_computations == per_step * len(selection_steps)
    assert stats.scored_tokens == per_step * sum(max(LENGTHS) + s for s in selection_steps)
    assert stats.kv_rows_read == LAYERS * heads * 12 * len(LENGTHS) * STEPS


def test_quest_counts_pages():
    stats = run(tiny_llama(), "quest", page_size=4, **SMALL)
    width = max(LENGTHS)
    assert stats.scored_tokens == 0
    assert stats.scored_pages == LAYERS * KV_HEADS * len(LENGTHS) * sum(pages_for(width + s, 4)
                                                                        for s in range(1, STEPS + 1))
    assert stats.kv_rows_read == LAYERS * KV_HEADS * 12 * len(LENGTHS) * STEPS


class ReadCounter:
    """Brute force: count the K/V rows the attention calls of decode steps really receive."""

    def __init__(self, monkeypatch):
        self.rows = 0
        sdpa, gather = attention_module.sdpa_attention_forward, attention_module.gather_attention
        dense = attention_module.split_decode_attention

        def count_dense(query, key, attention_mask):
            if query.shape[2] == 1 and key.shape[2] > 1:
                valid = valid_columns_from_mask(attention_mask, query.shape[0], key.shape[2], 1, query.device)
                self.rows += int(valid.sum()) * key.shape[1]

        def counting_sdpa(module, query, key, value, attention_mask, **kwargs):
            count_dense(query, key, attention_mask)
            return sdpa(module, query, key, value, attention_mask, **kwargs)

        def counting_dense(query, key, value, valid, scale):
            count_dense(query[:, :, None], key, None if valid is None else valid[:, None, None, :])
            return dense(query, key, value, valid, scale)

        def counting_gather(query, keys, values, indices, scale, partial=None):
            self.rows += int((indices >= 0).sum())
            return gather(query, keys, values, indices, scale, partial)

        monkeypatch.setattr(attention_module, "sdpa_attention_forward", counting_sdpa)
        monkeypatch.setattr(attention_module, "split_decode_attention", counting_dense)
        monkeypatch.setattr(attention_module, "gather_attention", counting_gather)


@pytest.mark.parametrize("model_name,preset,overrides", [
    ("llama", "dense", {}),
    ("llama", "ds", SMALL),
    ("llama", "hshare-1_2-1_2-1_2", SMALL),  # group lookahead: selection steps may read fewer than N_c
    ("llama", "hshare-3_4-3_4-1_2", dict(SMALL, selection="query_head", plan_scope="sample")),
    ("llama", "streaming", dict(sink=2, local=10)),
    ("llama", "quest-1_2-1_2-1_2", dict(SMALL, page_size=4)),
    ("llama", "ds", dict(sink=2, local=4, heavy=400)),  # every row within the budget: dense SDPA
    # dense fallback below 56 tokens (3 rows x Hkv 2 x d 16 x fp32 x K and V), sparse from step 5 on
    ("llama", "ds", dict(SMALL, dense_fallback_mib=3 * 2 * 16 * 4 * 2 * 56 / 2**20)),
    ("mistral", "hshare-1_2-1_2-1_2", dict(sink=2, local=3, heavy=5)),  # sliding window 24
])
def test_kv_rows_read_equal_what_attention_receives(monkeypatch, model_name, preset, overrides):
    model = tiny_llama() if model_name == "llama" else tiny_mistral(sliding_window=24)
    counter = ReadCounter(monkeypatch)
    lengths = LENGTHS if model_name == "llama" else [50, 36]
    stats = run(model, preset, lengths=lengths, new_tokens=12, prefix="off", **overrides)
    assert stats.kv_rows_read == counter.rows
    assert 0 < stats.kv_rows_read <= stats.dense_kv_rows


def prefix_prompts(suffixes, groups=None, seed=0):
    """Prompts: a common 20-token prefix, then (optionally) a group's own 6 tokens, then a suffix."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randint(3, 160, (20,), generator=gen)
    extra = {g: torch.randint(3, 160, (6,), generator=gen) for g in set(groups or [])}
    prompts = []
    for row, length in enumerate(suffixes):
        suffix = torch.randint(3, 160, (length,), generator=gen)
        suffix[0] = 3 + row  # rows differ right after what they share
        parts = [common] + ([extra[groups[row]]] if groups else []) + [suffix]
        prompts.append(torch.cat(parts))
    ids, mask = left_pad(prompts)
    return ids, mask, [len(p) for p in prompts]


@pytest.mark.parametrize("preset,overrides,own_budget", [("dense", {}, None), ("ds", SMALL, 12)])
def test_shared_prefix_is_read_once_per_group(preset, overrides, own_budget):
    model = tiny_llama()
    suffixes = [9, 14, 5]
    ids, mask, lengths = prefix_prompts(suffixes)
    with hshare.patched(model, preset, prefix="on", prefix_levels=1, **overrides):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=NEW, **cache_kwarg(cache))
    assert [level.width for level in cache.prefix.levels] == [20]
    stats = cache.stats
    own = lambda n: n if own_budget is None else min(own_budget, n)
    per_step = [KV_HEADS * (20 + sum(own(length + s) for length in suffixes)) for s in range(1, STEPS + 1)]
    assert stats.kv_rows_read == LAYERS * sum(per_step)
    assert stats.dense_kv_rows == dense_rows(lengths)


def test_two_prefix_levels_counted_per_group():
    model = tiny_llama()
    suffixes, groups = [4, 7, 3, 5], [0, 1, 0, 1]
    ids, mask, lengths = prefix_prompts(suffixes, groups)
    with hshare.patched(model, "dense", prefix="on", prefix_levels=2):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=NEW, **cache_kwarg(cache))
    levels = cache.prefix.levels
    assert len(levels) == 2 and levels[1].groups == 2
    shared = 0  # brute force: per level, each group that has rows, its valid tokens
    for level in levels:
        for group in range(level.groups):
            if (level.row_group == group).any():
                shared += int(level.key_valid[group].sum()) if level.key_valid is not None else level.width
    own = [length - 20 - 6 for length in lengths]
    expected = LAYERS * KV_HEADS * sum(shared + sum(n + s for n in own) for s in range(1, STEPS + 1))
    stats = cache.stats
    assert stats.kv_rows_read == expected
    assert stats.dense_kv_rows == dense_rows(lengths)


def test_stats_are_plain_ints_read_from_device_counters():
    model = tiny_llama()
    ids, mask = left_padded(LENGTHS)
    with hshare.patched(model, "ds", **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=4, **cache_kwarg(cache))
    assert all(t.dtype == torch.int64 and t.shape == (3,) for t in cache.planner.work.work.values())
    first = cache.stats
    assert all(type(v) is int for v in dataclasses.asdict(first).values())
    first.kv_rows_read = -1  # a snapshot: changing it changes nothing in the cache
    assert cache.stats.kv_rows_read > 0 and cache.stats == cache.stats
