"""The step planner's dense-or-sparse rule (`hshare.step.StepPlanner.sparse_pays`): a step runs sparse only
where it saves enough K/V reads per layer, counted by hand here."""

import pytest
import torch

import hshare
from hshare.config import HShareConfig

from conftest import greedy, left_padded, tiny_llama


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
        greedy(model, ids, mask, new_tokens=new_tokens, past_key_values=cache)
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
            greedy(model, ids, mask, new_tokens=4, past_key_values=cache)
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
