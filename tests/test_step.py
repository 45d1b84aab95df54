"""The step planner's dense-or-sparse rule (`hshare.step.StepPlanner.sparse_pays`): a step runs sparse only
where it saves enough K/V reads per layer, counted by hand here."""

import math
import os

import pytest
import torch

import hshare
from hshare.config import HShareConfig

from conftest import cache_kwarg, greedy, left_padded, tiny_llama


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_steps_run_sparse_once_they_save_the_threshold(kv_heads):
    model = tiny_llama(kv_heads=kv_heads, layers=2)
    lengths = [int(n) for n in torch.randint(20, 30, (2,))]
    ids, mask = left_padded(lengths)
    rows, width, new_tokens = ids.shape[0], ids.shape[1], 12
    config = HShareConfig.from_preset("ds").replace(sink=2, local=4, heavy=6, cuda_graphs=False)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    token_bytes = kv_heads * head_dim * 4 * 2  # K and V, float32
    crossing = int(torch.randint(2, new_tokens - 2, ()))  # the first decode step that saves enough
    saved_at = lambda step: rows * (width + step - config.budget.total) * token_bytes  # noqa: E731 - own columns at step
    threshold = (saved_at(crossing - 1) + saved_at(crossing)) / 2
    with hshare.patched(model, config.replace(dense_fallback_mib=threshold / 2**20)):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=new_tokens, **cache_kwarg(cache))
    stats = cache.stats
    decode_steps = new_tokens - 1
    assert stats.decode_steps == decode_steps
    assert stats.dense_fallback_steps == crossing - 1  # steps 1 .. crossing - 1 ran dense
    assert stats.sparse_steps == decode_steps - (crossing - 1)
    assert cache.planner.decision.startswith("sparse: a sparse step saves")
    assert f"{rows} rows x ({width + decode_steps} - {config.budget.total}) columns" in cache.planner.decision


def test_a_context_within_the_budget_never_pays():
    """Nothing is saved while every row fits N_c: dense at any positive threshold; 0 means sparse at any size."""
    model = tiny_llama(kv_heads=2, layers=2)
    ids, mask = left_padded([10, 7])
    for mib, dense_steps in ((1e-9, 3), (0, 0)):
        with hshare.patched(model, "ds", heavy=64, dense_fallback_mib=mib, cuda_graphs=False):
            cache = hshare.new_cache(model)
            greedy(model, ids, mask, new_tokens=4, **cache_kwarg(cache))
        assert cache.stats.dense_fallback_steps == dense_steps


def test_auto_threshold_by_device_and_graphs():
    config = HShareConfig()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert config.runtime.sparse_min_saved_bytes(cuda, graphs=True) == 96 * 2**20
    assert config.runtime.sparse_min_saved_bytes(cuda, graphs=False) == 768 * 2**20
    assert config.runtime.sparse_min_saved_bytes(cpu, graphs=True) == config.runtime.sparse_min_saved_bytes(cpu, graphs=False) == 0
    assert config.replace(dense_fallback_mib=5).runtime.sparse_min_saved_bytes(cuda, graphs=True) == 5 * 2**20
    # the shared prefix's rule: graphs on CUDA hold a level once from fewer saved reads than eager steps
    from hshare.config import AUTO_PREFIX_MIN_SAVED_TOKENS as auto
    assert config.prefix.min_saved(cuda, graphs=True) == auto["graphs"] < auto["eager"]
    assert config.prefix.min_saved(cuda, graphs=False) == config.prefix.min_saved(cpu, graphs=True) == auto["eager"]
    assert config.replace(prefix_min_saved_tokens=7).prefix.min_saved(cuda, graphs=True) == 7


@pytest.mark.parametrize("graphs", [True, False])
def test_a_policy_with_a_costlier_selection_needs_more_saved(graphs):
    """Quest's selection (every page scored and ranked) and Loki's (every projected key scored) add their
    `selection_min_saved_mib` to the auto threshold on CUDA; the label policy adds nothing; an explicit
    `dense_fallback_mib` and the CPU's 0 stay as they are. The planner's rule, on a stand-in CUDA cache, runs a
    step sparse exactly from that threshold and says why."""
    from types import SimpleNamespace

    from hshare.config import AUTO_MIN_SAVED_MIB
    from hshare.step import StepPlanner

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    base = AUTO_MIN_SAVED_MIB["graphs" if graphs else "eager"]
    labels, quest = HShareConfig.from_preset("ds@512"), HShareConfig.from_preset("quest@512")
    loki = HShareConfig.from_preset("loki")
    assert labels.policy.selection_min_saved_mib == 0
    assert labels.sparse_min_saved_bytes(cuda, graphs) == base * 2**20
    for costly in (quest, loki):
        extra = costly.policy.selection_min_saved_mib
        assert 0 < extra < math.inf
        assert costly.sparse_min_saved_bytes(cuda, graphs) == (base + extra) * 2**20
        assert costly.sparse_min_saved_bytes(cpu, graphs) == 0
        assert costly.replace(dense_fallback_mib=5).sparse_min_saved_bytes(cuda, graphs) == 5 * 2**20
    token_bytes = int(torch.randint(1, 9, ())) * 4096  # K and V of one token in one layer
    cache = SimpleNamespace(storage_device=cuda, layer_kv_bytes=lambda rows, columns: rows * columns * token_bytes)
    rows = int(torch.randint(1, 5, ()))
    for config in (labels, quest, loki):
        planner = StepPlanner(config, num_layers=2)
        needed = config.sparse_min_saved_bytes(cuda, graphs)
        first = -(-int(needed) // (rows * token_bytes)) + config.budget.total  # the fewest columns that save it
        assert not planner.sparse_pays(cache, rows, first - 1, graphs)
        assert planner.decision.startswith("dense")
        assert planner.sparse_pays(cache, rows, first, graphs)
        assert planner.decision.startswith("sparse")
        extra = config.policy.selection_min_saved_mib
        assert (f"of which {extra:g} for {config.policy.name}'s selection" in planner.decision) == (config is not labels)
    # the fallback off: sparse at any size
    assert StepPlanner(loki.replace(dense_fallback_mib=0), num_layers=2).sparse_pays(cache, rows, 1 + 128, graphs)


@pytest.mark.parametrize("policy", ["ds", "quest"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_each_step_gives_the_token_of_the_path_it_took(policy, kv_heads):
    """Whichever path the rule gives a step, its token is that path's when forced: the steps before the crossing
    give `dense`'s tokens, and the steps from it the tokens of a run forced sparse (``dense_fallback_mib=0``)
    whose prompt is extended by what the dense steps generated. The policies' metadata does not depend on where
    the prompt ends (labels of every channel, quantized per token; Quest's pages from the first valid column)
    and neither shares; float64, so that a key computed in a prefill equals the one a decode step computed."""
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; the message names the seed
    gen = torch.Generator().manual_seed(seed)
    model = tiny_llama(kv_heads=kv_heads, layers=2, dtype=torch.float64, seed=seed % 1000)
    ids, mask = left_padded([int(n) for n in torch.randint(20, 30, (3,), generator=gen)], generator=gen)
    rows, width, new_tokens = ids.shape[0], ids.shape[1], 12
    options = dict(label_channels=16) if policy == "ds" else dict(page_size=int(torch.randint(1, 5, (), generator=gen)))
    config = HShareConfig.from_preset(policy).replace(sink=2, local=4, heavy=6, cuda_graphs=False, **options)
    token_bytes = kv_heads * 16 * 8 * 2  # K and V of a token in a layer, float64, head_dim 16
    crossing = int(torch.randint(2, new_tokens - 2, (), generator=gen))  # the first decode step that runs sparse
    saved_at = lambda step: rows * (width + step - config.budget.total) * token_bytes  # noqa: E731
    threshold = (saved_at(crossing - 1) + saved_at(crossing)) / 2
    with hshare.patched(model, config.replace(dense_fallback_mib=threshold / 2**20)):
        cache = hshare.new_cache(model)
        ruled = greedy(model, ids, mask, new_tokens=new_tokens, **cache_kwarg(cache))
    assert cache.stats.dense_fallback_steps == crossing - 1 and cache.stats.sparse_steps == new_tokens - crossing, seed
    with hshare.patched(model, "dense"):
        dense = greedy(model, ids, mask, new_tokens=new_tokens)
    # the prefill's token and those of the dense steps 1 .. crossing - 1
    assert torch.equal(ruled[:, :width + crossing], dense[:, :width + crossing]), seed
    # decode step `crossing` reads the token the last dense step made: a prompt ending just before it
    extended = ruled[:, :width + crossing - 1]
    extended_mask = torch.cat([mask, torch.ones(rows, crossing - 1, dtype=mask.dtype)], 1)
    with hshare.patched(model, config.replace(dense_fallback_mib=0)):
        forced = greedy(model, extended, extended_mask, new_tokens=new_tokens - crossing + 1)
    assert torch.equal(forced, ruled), seed
    # the sparse steps chose (N_c 12 of 30+ columns): they read fewer K/V rows than dense attention would. (Their
    # tokens may still equal dense's: a few greedy steps of a tiny model can keep its argmax.)
    assert cache.stats.kv_rows_read < cache.stats.dense_kv_rows, seed
