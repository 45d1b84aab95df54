"""Programmatic dependent launch (`kernels.dependent_launch`, ``runtime.dependent_launch``): when launches ask
for it, that every hshare kernel keeps its contract (waits for the kernel before it before touching memory), and
that static decode steps turn it on as configured. Tokens under it: `tests/test_gpu_static_decode.py`."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import hshare
from hshare import static_decode
from hshare.kernels import dependent_launch
from hshare.kernels.dependent_launch import dependent_launches, pdl_options
from conftest import cache_kwarg, left_padded, tiny_llama

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "hshare" / "kernels"


@pytest.fixture
def capable(monkeypatch):
    """CUDA devices report compute capability 9 (no GPU needed: only the options are asked for)."""
    monkeypatch.setattr(dependent_launch, "_capable", lambda index: True)


def test_options_only_inside_the_block_and_on_a_capable_gpu(capable, monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert pdl_options(cuda) == {"PDL": False}
    with dependent_launches():
        assert pdl_options(cuda) == {"PDL": True, "launch_pdl": True}
        assert pdl_options(cpu) == {"PDL": False}  # the interpreter and the twins take no launch option
        with dependent_launches(False):
            assert pdl_options(cuda) == {"PDL": False}
        assert pdl_options(cuda) == {"PDL": True, "launch_pdl": True}
        monkeypatch.setattr(dependent_launch, "TRITON_HAS_PDL", False)  # a Triton before griddepcontrol
        assert pdl_options(cuda) == {"PDL": False}
        monkeypatch.setattr(dependent_launch, "TRITON_HAS_PDL", True)
        monkeypatch.setattr(dependent_launch, "_capable", lambda index: False)  # a GPU before Hopper
        assert pdl_options(cuda) == {"PDL": False}
    assert not dependent_launch._active
    with pytest.raises(RuntimeError), dependent_launches():  # restored on an error too
        raise RuntimeError
    assert not dependent_launch._active


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)}


def _launches(tree: ast.Module, kernels: dict) -> list[ast.Call]:
    """Calls ``kernel[grid](...)`` of this module's jit functions."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name) and node.func.value.id in kernels]


def test_every_launched_kernel_waits_first_and_every_launch_asks():
    """The contract a kernel launched with ``launch_pdl`` needs: its first statement (after its docstring) waits
    for the kernel before it; and every launch of it passes `pdl_options`, so none is left out of the gaps it
    removes. A new kernel that breaks either fails here."""
    launched = 0
    for path in sorted(KERNELS.glob("*_triton.py")):
        tree = ast.parse(path.read_text())
        kernels = {name: node for name, node in _jit_kernels(tree).items()}
        imported = {alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names}
        for call in _launches(tree, {**kernels, **{name: None for name in imported}}):
            name = call.func.value.id
            assert any(isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl_options"
                       for k in call.keywords if k.arg is None), f"{path.name}: a launch of {name} without pdl_options"
            launched += 1
        for name in {call.func.value.id for call in _launches(tree, kernels)}:
            node = kernels[name]
            params = [a.arg for a in node.args.args]
            assert params[-1] == "PDL", f"{path.name}:{name} takes no PDL constexpr last"
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                else node.body
            assert ast.unparse(body[0]) == "wait_for_previous_kernel(PDL)", f"{path.name}:{name} does not wait first"
    assert launched >= 18  # every kernel of a decode step (the walk found them)


@pytest.mark.parametrize("on", [True, False])
def test_static_steps_launch_dependently_as_configured(monkeypatch, on):
    """Decode steps of static shapes (what a CUDA graph captures) run inside `dependent_launches(on)`; the prefill
    and the code after the generate outside it."""
    monkeypatch.setattr(static_decode, "STATIC_ON_CPU", True)
    model = tiny_llama(layers=2)
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(
        (args[0].shape[1], dependent_launch._active)))
    ids, mask = left_padded([20, 13])
    hshare.patch(model, "hshare-1_2-1_2-1_2", sink=2, local=4, heavy=6, dependent_launch=on)
    cache = hshare.new_cache(model)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                   **cache_kwarg(cache))
    hshare.unpatch(model)
    assert cache.static_decode.reason == "" and cache.config.runtime.dependent_launch is on
    assert seen[0] == (ids.shape[1], False)  # the prefill
    assert seen[1:] == [(1, on)] * 3  # the decode steps
    assert not dependent_launch._active
