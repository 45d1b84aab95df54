"""The decoder layers' elementwise work as inductor-fused kernels inside a captured decode step.

A decode step of a Llama-family layer launches about 25 small elementwise kernels besides its
matmuls and attention: the two RMSNorms (upcast, square, mean, rsqrt, scale, downcast, weight),
the rotary embedding of the query and key (products, ``rotate_half``'s slices, negation and
concatenation, sum) and the MLP's activation times its up projection. Replayed one by one from a
CUDA graph they add a launch each (their cost: ``benchmarks/RESULTS.md``, the decode-step profile).
transformers' ``StaticCache`` path fuses them because ``generate`` compiles the
whole forward; hshare captures its own step (`hshare.static_decode` says why), so it compiles only
these pieces, through the model's own code:

* each ``*RMSNorm`` module's forward and each dense ``*MLP`` module's forward (the class's own
  ``forward``, compiled once per class and shared by every layer: the weights are inputs);
* the attention module's ``apply_rotary_pos_emb`` (the function its modeling file defines).

`ElementwiseFusion.active` swaps the compiled versions in only around the steps the decoder
records (the first, eager step of a kind and its capture); prefill and everything outside a
static decode run the model's code untouched. Each compiled function emulates the model's dtype
rounding (inductor's ``emulate_precision_casts``), so bf16 results match eager up to the order of
a reduction. Nothing here knows of HShare.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Callable, Iterator

import torch

from hshare import patches

_OPTIONS = {"emulate_precision_casts": True}  # round intermediates to the model's dtype as eager does
# one compiled function per class forward / rotary function and launch kind
_COMPILED: dict[tuple[Callable, bool], Callable] = {}


def _compiled(fn: Callable, dependent_launch: bool) -> Callable:
    """`fn` compiled by inductor; `dependent_launch`: its kernels are programmatic dependent launches on Hopper
    and newer (inductor's ``triton.enable_pdl``: each waits for the kernel before it before touching memory),
    where this PyTorch's inductor has the option."""
    if (fn, dependent_launch) not in _COMPILED:
        import torch._inductor.config as inductor

        has_pdl = getattr(inductor.triton, "enable_pdl", None) is not None
        options = _OPTIONS | ({"triton.enable_pdl": dependent_launch} if has_pdl else {})
        _COMPILED[fn, dependent_launch] = torch.compile(fn, fullgraph=True, options=options)
    return _COMPILED[fn, dependent_launch]


def _is_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def _is_dense_mlp(module: torch.nn.Module) -> bool:
    """A gated MLP (gate/up/down projections, one activation); MoE blocks are left alone (their
    experts see data-dependent token counts)."""
    return type(module).__name__.endswith("MLP") and all(
        isinstance(getattr(module, name, None), torch.nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


class ElementwiseFusion:
    """The fusable pieces of one model (see the module docstring).

    Args:
        model: a transformers causal LM of the Llama family.
        dependent_launch: the compiled kernels launch as programmatic dependent launches where the GPU
            has them (``runtime.dependent_launch``).

    Attributes:
        modules: the norm and MLP modules whose forward is swapped (those without an instance-level
            ``forward`` of their own, e.g. accelerate's hooks, which are left alone).
        rotary_owners: the modeling modules whose ``apply_rotary_pos_emb`` is swapped.
        compile_seconds: host seconds `warm_up` took (inductor compilation on first use).
    """

    def __init__(self, model: torch.nn.Module, dependent_launch: bool = False) -> None:
        self.model = model
        self.dependent_launch = dependent_launch
        self.modules = [m for m in model.modules()
                        if (_is_norm(m) or _is_dense_mlp(m)) and "forward" not in vars(m)]
        owners = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("Attention")}
        self.rotary_owners = [o for o in owners if callable(getattr(o, "apply_rotary_pos_emb", None))]
        self.compile_seconds = 0.0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The model's norms, MLPs and rotary embedding run compiled inside this block."""
        rotary = [(owner, owner.apply_rotary_pos_emb) for owner in self.rotary_owners]
        for module in self.modules:
            module.forward = functools.partial(_compiled(type(module).forward, self.dependent_launch), module)
        for owner, original in rotary:
            owner.apply_rotary_pos_emb = _compiled(original, self.dependent_launch)
        try:
            yield
        finally:
            for module in self.modules:
                del module.forward
            for owner, original in rotary:
                owner.apply_rotary_pos_emb = original

    def warm_up(self, rows: int) -> str | None:
        """Compile every piece for one decode step of `rows` rows (outside any capture) and check it
        runs; returns why fusion cannot be used (the compile error), or None."""
        config = self.model.config
        device, dtype = self.model.device, self.model.dtype
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = patches.head_dim(config)
        start = time.perf_counter()
        try:
            with torch.no_grad(), self.active():
                hidden = torch.zeros(rows, 1, config.hidden_size, device=device, dtype=dtype)
                for module in {type(m): m for m in self.modules}.values():  # one of each class
                    module(hidden)
                for owner in self.rotary_owners:  # q, k as the attention makes them: [B, H, 1, d] views
                    q = torch.zeros(rows, 1, heads * head_dim, device=device, dtype=dtype).view(rows, 1, heads, head_dim)
                    k = torch.zeros(rows, 1, kv_heads * head_dim, device=device, dtype=dtype).view(rows, 1, kv_heads, head_dim)
                    cos = torch.ones(rows, 1, head_dim, device=device, dtype=dtype)
                    owner.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, torch.zeros_like(cos))
        except Exception as error:  # noqa: BLE001 - no compiler, an unsupported op: decode unfused
            return f"{type(error).__name__}: {error}"
        finally:
            self.compile_seconds = time.perf_counter() - start
        return None
