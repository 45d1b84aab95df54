"""Stacked q/k/v projections (`hshare.projection_fusion`) against the model's own three products.

The fused product must give the separate products' outputs (float64: exactly the same dot products),
leave every parameter the same object with the same values and no second copy while stacked, give each its
own storage back afterwards (also under inference mode), and leave alone what it cannot stack.
"""

import pytest
import torch
import torch.nn.functional as F

from hshare.projection_fusion import PROJECTIONS, QKVFusion

from conftest import VOCAB, tiny_llama
from test_architectures import tiny


def _attentions(model):
    return [m for m in model.modules() if all(hasattr(m, name) for name in PROJECTIONS)]


def _logits(model, ids, fusion=None):
    with torch.no_grad():
        if fusion is None:
            return model(ids, use_cache=False).logits
        with fusion.active():
            return model(ids, use_cache=False).logits


@pytest.mark.parametrize("make", [lambda: tiny_llama(kv_heads=2, dtype=torch.float64),
                                  lambda: tiny_llama(kv_heads=4, dtype=torch.float64),
                                  lambda: tiny("qwen2", dtype=torch.float64)],  # q/k/v with biases
                         ids=["llama-gqa", "llama-mha", "qwen2-bias"])
@pytest.mark.parametrize("rows", [1, 3])
def test_stacked_product_equals_the_three_products(make, rows):
    model = make()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    objects = {name: p for name, p in model.named_parameters()}
    ids = torch.randint(3, VOCAB, (rows, 17))
    reference = _logits(model, ids)
    fusion = QKVFusion(model)
    fusion.stack()
    assert len(fusion.groups) == len(_attentions(model)) and fusion.reason == ""
    torch.testing.assert_close(_logits(model, ids, fusion), reference, rtol=1e-12, atol=1e-12)
    # the same parameter objects, the same values, each a view of its attention's stacked tensor
    for name, parameter in model.named_parameters():
        assert parameter is objects[name] and torch.equal(parameter, before[name])
    for group in fusion.groups:
        assert group.stacked()
        for projection in group.projections:
            assert projection.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    # outside the block the modules' own forwards run again
    assert all("forward" not in vars(p) for g in fusion.groups for p in g.projections)
    torch.testing.assert_close(_logits(model, ids), reference, rtol=1e-12, atol=1e-12)


def test_stacking_keeps_no_second_copy_and_unstacking_gives_each_its_storage():
    model = tiny_llama(kv_heads=2, dtype=torch.float64)
    attention = _attentions(model)[0]
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    before = [p.weight.detach().clone() for p in projections]
    fusion = QKVFusion(model)
    fusion.stack()
    assert len({p.weight.untyped_storage().data_ptr() for p in projections}) == 1
    group = fusion.groups[0]
    assert group.weight.untyped_storage().nbytes() == group.weight.numel() * group.weight.element_size()
    fusion.stack()  # stacked already: nothing moves
    assert group.stacked() and attention.q_proj.weight.data_ptr() == group.weight.data_ptr()
    fusion.unstack()
    assert group.weight is None and not group.stacked()
    assert len({p.weight.untyped_storage().data_ptr() for p in projections}) == 3
    for projection, weight in zip(projections, before):
        assert torch.equal(projection.weight, weight)
        assert projection.weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()


def test_stacked_under_inference_mode_stays_usable_with_autograd():
    model = tiny_llama(kv_heads=2, dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (2, 9))
    fusion = QKVFusion(model)
    with torch.inference_mode():
        fusion.stack()
        with fusion.active():
            inside = model(ids, use_cache=False).logits
        fusion.unstack()
    assert not any(p.is_inference() for p in model.parameters())
    model(ids, use_cache=False).logits.sum().backward()  # autograd through the parameters still works
    torch.testing.assert_close(inside, model(ids, use_cache=False).logits.detach(), rtol=1e-12, atol=1e-12)


def test_parameters_rewritten_while_stacked_land_in_the_stack():
    model = tiny_llama(kv_heads=2, dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (2, 11))
    fusion = QKVFusion(model)
    fusion.stack()
    fresh = tiny_llama(kv_heads=2, dtype=torch.float64, seed=5)
    model.load_state_dict(fresh.state_dict())  # copies into the parameters: into the stacked tensors
    assert all(group.stacked() for group in fusion.groups)
    torch.testing.assert_close(_logits(model, ids, fusion), _logits(fresh, ids), rtol=1e-12, atol=1e-12)
    model.to(torch.float32)  # new tensors for every parameter: no longer the stacked rows, left as they are
    assert not any(group.stacked() for group in fusion.groups)
    fusion.unstack()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_projection_of_another_input_runs_its_own_product():
    model = tiny_llama(kv_heads=2, dtype=torch.float64)
    fusion = QKVFusion(model)
    fusion.stack()
    attention = _attentions(model)[0]
    x, y = torch.randn(2, 1, 64, dtype=torch.float64), torch.randn(2, 1, 64, dtype=torch.float64)
    with fusion.active():
        q = attention.q_proj(x)
        k = attention.k_proj(y)  # cross-attention style: another input
        v = attention.v_proj(x)
        q_again = attention.q_proj(y)  # after k took its part of y's product
        k_again = attention.k_proj(y)  # the same projection twice on one input
    for out, module, hidden in ((q, attention.q_proj, x), (k, attention.k_proj, y), (v, attention.v_proj, x),
                                (q_again, attention.q_proj, y), (k_again, attention.k_proj, y)):
        torch.testing.assert_close(out, F.linear(hidden, module.weight), rtol=1e-12, atol=1e-12)


def test_projections_it_cannot_stack_are_left_alone():
    model = tiny_llama(kv_heads=2, layers=3, dtype=torch.float64)
    attentions = _attentions(model)
    attentions[1].k_proj.register_forward_hook(lambda module, args, out: out)  # e.g. an adapter's hook
    fusion = QKVFusion(model)
    assert len(fusion.groups) == 2 and attentions[1].q_proj not in [g.projections[0] for g in fusion.groups]
    weight = attentions[1].q_proj.weight.data
    fusion.stack()
    assert attentions[1].q_proj.weight.data.data_ptr() == weight.data_ptr()  # untouched
    ids = torch.randint(3, VOCAB, (2, 9))
    torch.testing.assert_close(_logits(model, ids, fusion), _logits(model, ids), rtol=1e-12, atol=1e-12)
    phi3 = tiny("phi3", dtype=torch.float64)  # one qkv_proj already: nothing to stack
    assert QKVFusion(phi3).groups == [] and "q_proj" in QKVFusion(phi3).reason
