"""The layers' elementwise work compiled for captured decode steps (`hshare.elementwise_fusion`).

Compiling runs inductor (a C++ compiler on the CPU), so the compiling tests are marked slow; the
GPU test file checks the fused graph path against the unfused one end to end.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral

from hshare import elementwise_fusion
from hshare.elementwise_fusion import ElementwiseFusion
from conftest import VOCAB, tiny_llama, tiny_mistral


def test_pieces_found_through_the_model_code():
    model = tiny_llama(layers=3)
    fusion = ElementwiseFusion(model)
    names = sorted(type(m).__name__ for m in fusion.modules)
    assert names == ["LlamaMLP"] * 3 + ["LlamaRMSNorm"] * 7  # 2 a layer + the final norm
    assert fusion.rotary_owners == [modeling_llama]
    assert ElementwiseFusion(tiny_mistral()).rotary_owners == [modeling_mistral]


def test_hooked_modules_left_alone():
    model = tiny_llama(layers=2)
    hooked = model.model.layers[0].mlp
    hooked.forward = hooked.forward  # an instance-level forward, as accelerate's hooks install
    assert hooked not in ElementwiseFusion(model).modules


def test_active_swaps_and_restores(monkeypatch):
    compiled, calls, launches = {}, {}, set()

    def fake_compile(fn, dependent_launch):
        launches.add(dependent_launch)

        def call(*args, **kwargs):
            calls[fn] = calls.get(fn, 0) + 1
            return fn(*args, **kwargs)
        return compiled.setdefault(fn, call)

    monkeypatch.setattr(elementwise_fusion, "_compiled", fake_compile)
    model = tiny_llama(layers=2)
    fusion = ElementwiseFusion(model, dependent_launch=True)
    original = modeling_llama.apply_rotary_pos_emb
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        reference = model(ids).logits
        with fusion.active():
            assert modeling_llama.apply_rotary_pos_emb is compiled[original]
            assert all(m.forward.func is compiled[type(m).forward] and m.forward.args == (m,) for m in fusion.modules)
            assert torch.equal(model(ids).logits, reference)
    norm, mlp = type(model.model.norm), type(model.model.layers[0].mlp)
    assert calls == {original: 2, norm.forward: 5, mlp.forward: 2}  # the swapped functions are the ones called
    assert launches == {True}  # every piece compiled for dependent launches, as asked
    assert modeling_llama.apply_rotary_pos_emb is original
    assert all("forward" not in vars(m) for m in fusion.modules)
    with pytest.raises(RuntimeError), fusion.active():  # restored on an error too
        raise RuntimeError
    assert modeling_llama.apply_rotary_pos_emb is original and all("forward" not in vars(m) for m in fusion.modules)


def test_warm_up_reports_a_compile_error(monkeypatch):
    def broken(fn, dependent_launch):
        def call(*args, **kwargs):
            raise RuntimeError("no compiler")
        return call

    monkeypatch.setattr(elementwise_fusion, "_compiled", broken)
    fusion = ElementwiseFusion(tiny_llama(layers=1))
    assert fusion.warm_up(rows=2) == "RuntimeError: no compiler"
    assert modeling_llama.apply_rotary_pos_emb is not None and all("forward" not in vars(m) for m in fusion.modules)


@pytest.mark.parametrize("dependent_launch", [False, True])
def test_compiled_asks_inductor_for_dependent_launches_or_not(monkeypatch, dependent_launch):
    asked = []
    monkeypatch.setattr(elementwise_fusion, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, fullgraph, options: asked.append(options) or fn)
    fn = lambda x: x + 1  # noqa: E731
    assert elementwise_fusion._compiled(fn, dependent_launch) is fn
    assert elementwise_fusion._compiled(fn, dependent_launch) is fn  # compiled once per function and launch kind
    assert asked == [{"emulate_precision_casts": True, "triton.enable_pdl": dependent_launch}]


@pytest.mark.slow  # inductor compiles three graphs with the C++ compiler (~30 s on 2 cores)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_compiled_forward_equals_eager(kv_heads):
    model = tiny_llama(kv_heads=kv_heads, layers=3)
    fusion = ElementwiseFusion(model)
    assert fusion.warm_up(rows=3) is None and fusion.compile_seconds > 0
    ids = torch.randint(3, VOCAB, (3, 17))
    with torch.no_grad():
        reference = model(ids).logits
        with fusion.active():
            fused = model(ids).logits
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    assert not torch.equal(reference, torch.zeros_like(reference))
    torch._dynamo.reset()  # free the compiled graphs and their fake tensors for the tests after this one
