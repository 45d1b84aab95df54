"""The sparse layers' prefill metadata (labels, Quest pages, the planner's evidence) is built once the
prefill forward is done, never beside its activations (`hshare.prefill_metadata`)."""

import pytest
import torch

import hshare
from hshare.kernels import quantize_labels

from conftest import cache_kwarg, greedy, left_padded, tiny_llama

SMALL = dict(sink=2, local=4, heavy=6, dense_fallback_mib=0)


def metadata_during_prefill(model, cache):
    """Hook the last decoder layer's MLP: what the sparse layers held while a prefill ran there."""
    seen = []

    def record(module, args, output):
        if args[0].shape[1] > 1:  # a prefill forward (several query rows)
            seen.append([(cache.layers[i].policy is not None,
                          cache.layers[i].policy.length if cache.layers[i].policy is not None else None,
                          i in cache.planner.pending) for i in cache.sparse_layers])

    return seen, model.model.layers[-1].mlp.register_forward_hook(record)


@pytest.mark.parametrize("preset", ["ds", "hshare-1_2-1_2-1_2", "quest"])
def test_metadata_is_built_after_the_prefill_forward(preset):
    model = tiny_llama(layers=4)
    lengths = [int(n) for n in torch.randint(20, 40, (3,))]
    ids, mask = left_padded(lengths)
    with hshare.patched(model, preset, **SMALL):
        cache = hshare.new_cache(model)
        seen, hook = metadata_during_prefill(model, cache)
        try:
            greedy(model, ids, mask, new_tokens=1, **cache_kwarg(cache))  # the prefill only
        finally:
            hook.remove()
    assert seen and cache.sparse_layers
    # inside the forward: every sparse layer has its policy (made from the prompt's queries) but no
    # token metadata yet, and waits for it
    assert all(made and length == 0 and waiting for made, length, waiting in seen[0])
    # after the forward: every prompt column is covered, nothing is pending
    columns = ids.shape[1]
    for index in cache.sparse_layers:
        layer = cache.layers[index]
        assert index not in cache.planner.pending and layer.policy.length == columns
    if cache.config.policy.name == "labels":  # the labels are those of the cached keys
        for index in cache.sparse_layers:
            layer, policy = cache.layers[index], cache.layers[index].policy
            keys = layer.keys  # [B, Hkv, n, d]; selection per KV head here
            channels = policy.channels.expand(keys.shape[0], -1, -1)
            picked = keys.gather(-1, channels[:, :, None, :].expand(-1, -1, keys.shape[2], -1))
            codes, scale, zero = quantize_labels(picked, policy.bits)
            assert torch.equal(policy.codes.view(), codes)
            assert torch.equal(policy.scale.view(), scale) and torch.equal(policy.zero.view(), zero)
    if cache.config.sharing.shares_layers_or_heads:  # the planner's evidence of every sparse layer is there
        assert sorted(cache.planner.head_similarity) == cache.sparse_layers
        assert sorted(cache.planner.layer_similarity) == cache.sparse_layers


def test_a_forward_without_the_model_hook_is_completed_before_decode():
    """A prefill through the decoder alone (no model-level hook) leaves the metadata pending; the
    next decode step builds it first, and decodes what a generate does."""
    model = tiny_llama(layers=3)
    ids, mask = left_padded([31, 26])
    with hshare.patched(model, "hshare-1_2-1_2-1_2", **SMALL):
        want = greedy(model, ids, mask, new_tokens=4)
        cache = hshare.new_cache(model)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwarg(cache),
                             use_cache=True).last_hidden_state
        assert all(i in cache.planner.pending for i in cache.sparse_layers)
        first = model.lm_head(hidden[:, -1]).argmax(-1, keepdim=True)
        tokens = [first]
        for step in range(3):
            mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
            out = model(input_ids=tokens[-1], attention_mask=mask, position_ids=positions[:, -1:] + step + 1,
                        **cache_kwarg(cache), use_cache=True)
            assert not cache.planner.pending
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    assert torch.equal(torch.cat(tokens, dim=1), want[:, ids.shape[1]:])


@pytest.mark.parametrize("preset", ["hshare-1_2-1_2-1_2", "quest-1_2-1_2-1_2"])
def test_evidence_held_through_the_forward_is_what_the_policy_scores(preset):
    """The planner's evidence waits through the forward in the form its policy scores
    (`SelectionPolicy.score_query`): labels keep the query labels ``[B, H_sel, W, r]`` (not the queries),
    Quest a copy of the queries (not a view of the forward's tensor). The layers share one copy of the
    keys' validity. On a GPU both wait in pinned host memory, off the device at the forward's peak."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama(layers=4, kv_heads=2).to(device)
    ids, mask = (t.to(device) for t in left_padded([int(n) for n in torch.randint(20, 40, (3,))]))
    held = []

    def record(module, args, output):
        if args[0].shape[1] > 1:
            held.extend(cache.planner.pending[i] for i in cache.sparse_layers)

    with hshare.patched(model, preset, **SMALL):
        cache = hshare.new_cache(model)
        hook = model.model.layers[-1].mlp.register_forward_hook(record)
        try:
            greedy(model, ids, mask, new_tokens=1, **cache_kwarg(cache))
        finally:
            hook.remove()
    config, rows = cache.config, cache.config.planner.rows
    assert len(held) == len(cache.sparse_layers) > 1
    assert all(pending.valid is held[0].valid for pending in held)  # one copy of the keys' validity per forward
    assert held[0].valid.device.type == "cpu" and (device == "cpu" or held[0].valid.is_pinned())
    assert held[0].valid._base is None and cache.planner.prefill_valid is None  # a copy, dropped once complete
    for evidence in (pending.evidence_query for pending in held):
        assert evidence._base is None
        assert evidence.device.type == "cpu" and (device == "cpu" or evidence.is_pinned())
        if config.policy.name == "labels":
            assert evidence.shape == (3, cache.sel_heads, rows, config.policy.channels)
        else:
            assert evidence.shape == (3, cache.q_heads, rows, model.config.head_dim)


@pytest.mark.parametrize("preset", ["loki", "hshare-1_2-1_2-1_2"])
def test_policy_row_tensors_wait_off_the_device_through_the_forward(preset, monkeypatch):
    """A policy made inside the prefill forward keeps its per-row state (Loki's principal directions
    ``[B, Hkv, d, r]`` fp32, the labels' channels) parked through the rest of the forward
    (pinned host memory on a GPU) and back on the keys' device once the metadata is built: decode then
    selects what an unparked policy selects (the tokens equal the same preset's with parking a no-op)."""
    from hshare import prefill_metadata

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama(layers=4, kv_heads=2).to(device)
    ids, mask = (t.to(device) for t in left_padded([int(n) for n in torch.randint(20, 40, (3,))]))
    with hshare.patched(model, preset, **SMALL):
        want = greedy(model, ids, mask, new_tokens=4)
    parked, during = set(), []
    park = prefill_metadata.park

    def recording_park(tensor):
        out = park(tensor)
        parked.add(id(out))
        return out

    def record(module, args, output):
        if args[0].shape[1] > 1:
            for i in cache.sparse_layers:
                policy = cache.layers[i].policy
                names = policy.row_tensors + policy.row_or_shared_tensors
                during.extend((name, getattr(policy, name)) for name in names if getattr(policy, name) is not None)

    monkeypatch.setattr(prefill_metadata, "park", recording_park)
    with hshare.patched(model, preset, **SMALL):
        cache = hshare.new_cache(model)
        hook = model.model.layers[-1].mlp.register_forward_hook(record)
        try:
            got = greedy(model, ids, mask, new_tokens=4, **cache_kwarg(cache))
        finally:
            hook.remove()
    assert during  # every policy here has row state
    assert all(id(tensor) in parked for _, tensor in during)
    assert all(tensor.device.type == "cpu" and (device == "cpu" or tensor.is_pinned()) for _, tensor in during)
    for i in cache.sparse_layers:  # back on the keys' device (on a GPU: not the parked host copies)
        policy = cache.layers[i].policy
        for name in policy.row_tensors + policy.row_or_shared_tensors:
            tensor = getattr(policy, name)
            assert tensor is None or tensor.device == cache.layers[i].keys.device
    assert torch.equal(got, want)
