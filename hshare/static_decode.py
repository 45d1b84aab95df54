"""Static-shape decode inside ``generate``, each kind of step replayed as a CUDA graph.

Eager decode of a 7B model launches hundreds of kernels a step; the HShare step adds selection
and gather kernels per layer, so eager ``generate`` is bound by the host. This module removes the
host from the step:

1. **Static shapes.** The cache's buffers are reserved once at their final size (the own prompt
   plus ``max_new_tokens`` - 1: `reserved_columns`) before prefill, and decode sees them whole
   (`HShareCache.freeze`): the token is written at a column held in a device tensor, key validity is
   a ``[B, capacity]`` device tensor, the heavy columns of a selection live in per-layer buffers.
   Every data-dependent decision is a device tensor (`hshare.step`), so a decode step never reads
   the device.
2. **Graphs per step kind.** The host knows each step's kind without reading the device
   (``"dense"``, ``"select"``, ``"reuse"``: `hshare.step.STEP_KINDS`); the first step of a kind runs
   eagerly and is captured (`hshare.graphs.StepGraphs`), later ones replay it. Where this process
   has captured a step of the same `warm_signature` before (a later ``generate`` of the same
   shapes), the first step of a kind is captured at once and replayed, with no eager run. A step
   costs a few small host launches (the inputs, the column, the validity) plus one graph launch.
3. **Fused elementwise work and projections.** Inside the recorded steps the layers' norms, rotary
   embedding and MLP activation run compiled by inductor (`hshare.elementwise_fusion`,
   ``compile_elementwise``): what transformers' compiled StaticCache path fuses, without compiling the
   step itself; and each attention's q, k and v projections run as one product over stacked weights
   (`hshare.projection_fusion`, ``fuse_projections``).
4. **Plan on the host, open in the graph.** Each step is planned on the host as in eager decode
   (`hshare.step.StepPlanner.begin_static_step`: kind, schedule, plan, host counters); the captured
   step opens it (the decoder's pre-hook: row windows from the device validity) and runs the layers,
   so a replay rebuilds everything that depends on the rows' data.

Why our own capture and not ``torch.compile`` (transformers' route for ``StaticCache``): the step's
kind is host control flow (a compiled forward would guard on it and recompile or need the plan in
data-dependent form), the Triton kernels would need ``torch.library`` wrappers, and compiling a
7B forward takes tens of seconds per shape while capture takes milliseconds per kind (``hshare
bench generate`` reports both). Capture needs nothing from the model but a forward without
host syncs, so any architecture the patch supports gets it.

Where static decode does not apply, ``generate`` decodes eagerly (same tokens) and
``cache.static_decode.reason`` says why: ``cuda_graphs=False``, not CUDA, a model spread over
devices, beam search / assisted decoding, per-token outputs (attentions, hidden states), a
capture that failed (e.g. a rotary embedding that reads the
device), or a generation that outgrows its reserved length (it goes on eagerly).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from hshare import compat
from hshare.cache import HShareCache
from hshare.elementwise_fusion import ElementwiseFusion
from hshare.projection_fusion import QKVFusion
from hshare.graphs import StepGraphs
from hshare.generate_features import eager_reason, generation_setting
from hshare.patches import sliding_window
from hshare.selection import own_key_validity
from hshare.step import DecodeStep
from hshare.kernels.dependent_launch import dependent_launches

# Static shapes off CUDA (no graphs: every step runs eagerly on the static buffers). Only tests turn
# it on: it is the CPU check that static-shape decode gives eager decode's tokens.
STATIC_ON_CPU = False

_STEP_INPUTS = ("input_ids", "position_ids", "cache_position")  # per-step tensors copied into static buffers
# per model: the step signatures (`warm_signature`) this process has run eagerly and captured
_WARMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class StaticDecodeReport:
    """What static decode did in one ``generate`` (``cache.static_decode``).

    Attributes:
        reason: why decoding was (or became) eager; "" when every step after the first of each
            kind replayed a graph.
        replays: graph replays per step kind.
        eager_steps: decode steps run eagerly (the first of each kind, and any after a fallback).
        capture_seconds: host seconds spent capturing each kind.
        reserved: own columns per row the buffers were reserved for.
        fusion: how the captured steps run the layers' elementwise work: "fused" (inductor kernels,
            `hshare.elementwise_fusion`), or why not ("compile_elementwise=False", a compile error).
        projections: how they run the attention's q, k and v projections: "stacked" (one product per
            attention, `hshare.projection_fusion`), or why not ("fuse_projections=False", the modules).
        compile_seconds: host seconds spent compiling the fused pieces (0 once compiled at this shape).
        eager_seconds: seconds of the eager steps run before a capture (none where this process ran a
            step of the same kind and signature before: `warm_signature`).
    """

    reason: str = ""
    replays: dict[str, int] = field(default_factory=dict)
    eager_steps: int = 0
    capture_seconds: dict[str, float] = field(default_factory=dict)
    reserved: int = 0
    fusion: str = ""
    projections: str = ""
    compile_seconds: float = 0.0
    eager_seconds: float = 0.0

    @property
    def graphed_steps(self) -> int:
        return sum(self.replays.values())


def new_token_budget(model, kwargs: dict, prompt_width: int) -> int | None:
    """Tokens ``generate`` may add: ``max_new_tokens``, else ``max_length`` minus the prompt."""
    new_tokens = generation_setting(model, kwargs, "max_new_tokens")
    if new_tokens is None:
        max_length = generation_setting(model, kwargs, "max_length")
        new_tokens = None if max_length is None else max_length - prompt_width
    return None if new_tokens is None else max(0, int(new_tokens))


def reserved_columns(prompt_width: int, new_tokens: int) -> int:
    """Own columns a generation of `new_tokens` fills: the prompt and every new token but the last (the
    last is sampled from the final step's logits and never fed back), as transformers' StaticCache sizes
    ``max_cache_len``."""
    return prompt_width + max(new_tokens - 1, 0)


def placement_devices(model) -> list[str]:
    """The devices accelerate's ``device_map`` put the model's modules on (empty when it was not dispatched)."""
    return sorted({str(device) for device in (getattr(model, "hf_device_map", None) or {}).values()})


def static_decode_unsupported(model, cache: HShareCache, kwargs: dict) -> str | None:
    """Why this ``generate`` call cannot decode with static shapes, or None."""
    config = cache.config
    if not config.runtime.cuda_graphs:
        return "cuda_graphs=False"
    if model.device.type != "cuda" and not STATIC_ON_CPU:
        return f"the model is on {model.device.type}, CUDA graphs need CUDA"
    devices = placement_devices(model)
    if len(devices) > 1:
        return f"the model is spread over devices {devices}"
    if (getattr(model, "tp_size", None) or 1) > 1:  # a rank failing a capture would leave the others waiting
        return (f"tensor parallelism (tp_size={model.tp_size}): capture of the model's collectives in CUDA graphs "
                "is not yet tested on several GPUs")
    reason = eager_reason(model, kwargs)
    if reason is not None:
        return reason
    if cache.get_seq_length():
        return "the cache given to generate already holds tokens"
    return None


class StaticDecoder:
    """The model's forward during one ``generate`` call: eager prefill, static-shape decode steps
    replayed as CUDA graphs (installed on the instance by the patched ``generate``).

    Args:
        model: the patched model.
        forward: the forward it replaces (the class's, or an instance hook's such as accelerate's).
        new_tokens: tokens the call may add (`new_token_budget`).
        report: where to record what happened (``cache.static_decode``).
    """

    def __init__(self, model, forward, new_tokens: int, report: StaticDecodeReport) -> None:
        self.forward = forward
        self.__signature__ = inspect.signature(forward)  # generate reads which inputs the forward takes
        self.new_tokens = new_tokens
        self.report = report
        self.model = model
        self.window = sliding_window(model.config)
        self.fusion: ElementwiseFusion | None = None
        self.projections: QKVFusion | None = None
        self.graphs: StepGraphs | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.constants: dict[str, Any] = {}
        self.steps: dict[str, DecodeStep] = {}  # the step each captured kind opened (its tensors are the graph's)
        self.cache: HShareCache | None = None

    def __call__(self, *args, **kwargs):
        cache = compat.cache_from(kwargs)
        ids = kwargs.get("input_ids")
        if args or not isinstance(cache, HShareCache) or ids is None or cache.filling_prefix or self.report.reason:
            return self.forward(*args, **kwargs)
        if cache.own_length == 0:  # the rows' own prefill: every buffer reserved at its final size, then frozen
            if not cache.reserve:
                cache.set_reserve(reserved_columns(ids.shape[1], self.new_tokens))
                self.report.reserved = cache.reserve
            output = self.forward(**kwargs)
            self._freeze(cache)
            return output
        if ids.shape[1] != 1:
            return self._fall_back(cache, f"a forward of {ids.shape[1]} tokens after prefill", kwargs)
        return self._decode(cache, kwargs)

    # ---- one decode step ----------------------------------------------------------------
    def _decode(self, cache: HShareCache, kwargs: dict):
        if cache.static is None:
            return self._fall_back(cache, "the cache was not frozen after its prefill", kwargs)
        if not self.inputs:
            reason = self._first_decode(cache, kwargs)
            if reason:
                return self._fall_back(cache, reason, kwargs)
        if cache.own_length + 1 > cache.reserve:
            return self._fall_back(cache, f"the generation outgrew its reserved {cache.reserve} columns", kwargs)
        kind = cache.planner.begin_static_step(cache).kind
        column = cache.own_length
        cache.advance(1)
        width = column + 1
        static = cache.static
        static.column.fill_(column)
        own_key_validity(kwargs.get("attention_mask"), static.valid.shape[0], width, self.window, static.valid.device,
                         out=static.valid[:, :width])
        for name, buffer in self.inputs.items():
            buffer.copy_(kwargs[name])
        if self.graphs is None:  # static shapes without graphs (off CUDA: tests)
            logits = self._step()
            self.report.eager_steps += 1
        elif kind in self.graphs:
            logits = self.graphs.replay(kind).clone()
            cache.planner.current = self.steps[kind]
        else:
            logits = self._first_of_kind(cache, kind)
        return compat.causal_lm_output(logits, cache)

    def _first_of_kind(self, cache: HShareCache, kind: str) -> torch.Tensor:
        """The first step of `kind` in this generate: captured, and run as a replay when a step of the
        same signature ran in this process before (`warm_signature`), else run eagerly first (Triton
        compilation, library set-up) and then captured. A capture that fails runs the step eagerly; a
        second failure turns graphs off for the rest of the generate (`StaticDecodeReport.reason`)."""
        signature = warm_signature(cache, kind)
        warmed = _WARMED.setdefault(self.model, set())
        if signature in warmed:
            try:
                logits = self.graphs.capture_and_replay(kind, self._step).clone()
            except Exception:  # noqa: BLE001 - whatever the capture refused, the cold path below handles
                warmed.discard(signature)
            else:
                self.steps[kind] = cache.planner.current
                return logits
        start = time.perf_counter()
        logits = self.graphs.eager(self._step)
        torch.cuda.synchronize(cache.static.valid.device)
        self.report.eager_seconds += time.perf_counter() - start
        self.report.eager_steps += 1
        eager_step = cache.planner.current
        try:
            self.graphs.capture(kind, self._step)
        except Exception as error:  # noqa: BLE001 - anything the forward does that capture refuses
            self.report.reason = f"capturing a {kind!r} step failed: {type(error).__name__}: {error}"
            cache.planner.current = eager_step
            cache.thaw()
        else:
            self.steps[kind] = cache.planner.current
            warmed.add(signature)
        return logits

    def _step(self) -> torch.Tensor:
        """One decode step over the static buffers (the decoder's pre-hook opens the planned step)."""
        with contextlib.ExitStack() as fused:
            for fusion in (self.fusion, self.projections):
                if fusion is not None:
                    fused.enter_context(fusion.active())
            fused.enter_context(dependent_launches(self.cache.config.runtime.dependent_launch))
            return self.forward(**self.inputs, **self.constants, **{compat.CACHE_KWARG: self.cache},
                                attention_mask=None, use_cache=True, return_dict=True).logits

    def _freeze(self, cache: HShareCache) -> None:
        """After the own prefill: the prefill's metadata built and the buffers frozen, so that the next
        forward is planned as a static step (`hshare.step.StepPlanner.begin_forward`)."""
        if cache.reserve != cache.own_capacity:
            self.report.reason = "the cache's buffers were not reserved at the generation's final length"
            return
        cache.planner.finish_prefill(cache)
        static = cache.freeze()
        cache.planner.work.on(static.valid.device)  # before any capture: made in one, a replay would zero them
        self.cache = cache

    def _first_decode(self, cache: HShareCache, kwargs: dict) -> str | None:
        """The step's input buffers, the graphs and the fused elementwise work, at the first decode step;
        or why static decode cannot go on."""
        missing = [name for name in ("input_ids", "position_ids") if kwargs.get(name) is None]
        if missing:
            return f"generate passed no {', '.join(missing)}"
        self.inputs = {name: kwargs[name].clone() for name in _STEP_INPUTS if isinstance(kwargs.get(name), torch.Tensor)}
        self.constants = {name: value for name, value in compat.without_cache(kwargs).items()
                          if name not in (*_STEP_INPUTS, "attention_mask", "use_cache", "return_dict")
                          and not isinstance(value, torch.Tensor)}
        device = cache.static.valid.device
        self.graphs = StepGraphs(device) if device.type == "cuda" else None
        if self.graphs is not None:  # the report shows the graphs' own counts (kept as they capture and replay)
            self.report.replays, self.report.capture_seconds = self.graphs.replays, self.graphs.capture_seconds
        self._fuse(cache)
        return None

    def _fuse(self, cache: HShareCache) -> None:
        """Stack the attention's projections for the recorded steps, and on CUDA compile the layers'
        elementwise work for them, where the config asks for it (static shapes off CUDA run in tests only:
        they stack, and leave inductor out)."""
        if not cache.config.runtime.fuse_projections:
            self.report.projections = "fuse_projections=False"
        else:
            projections = QKVFusion(self.model)
            projections.stack()
            self.report.projections = projections.reason or "stacked"
            self.projections = projections if projections.groups else None
        if self.graphs is None:
            return
        if not cache.config.runtime.compile_elementwise:
            self.report.fusion = "compile_elementwise=False"
            return
        fusion = ElementwiseFusion(self.model, dependent_launch=cache.config.runtime.dependent_launch)
        error = fusion.warm_up(cache.static.valid.shape[0])
        self.report.compile_seconds = fusion.compile_seconds
        self.report.fusion = error or "fused"
        self.fusion = None if error else fusion

    def close(self) -> None:
        """At the end of the generate: the projections' parameters back in their own storage."""
        if self.projections is not None:
            self.projections.unstack()
            self.projections = None

    def _fall_back(self, cache: HShareCache, reason: str, kwargs: dict):
        """Decode eagerly from here on (same tokens), saying why."""
        self.report.reason = self.report.reason or reason
        if cache.static is not None:
            cache.thaw()
        self.report.eager_steps += int(kwargs["input_ids"].shape[1] == 1)
        return self.forward(**kwargs)


def warm_signature(cache: HShareCache, kind: str) -> tuple:
    """What a decode step's kernels and libraries are warmed up for, beyond the model: the step kind,
    every shape the step's kernels see (rows, reserved columns, heads, dtype), the config, the shapes of
    the compiled plan's work and the shared prefix's layout. Two generates with equal signatures launch
    kernels of the same shapes; only their data differ (new prompts, a new plan of the same shapes), so
    the second needs no eager warm-up before its capture. A signature that misses a specialisation costs
    a failed capture, after which the step runs eagerly (`StaticDecoder._first_of_kind`)."""
    keys = cache.key_storage
    planner = cache.planner
    # the plan's work per layer as shapes, as a set: which layer selects and which one it copies from
    # change the tensors a step reads, not the kernels or their shapes
    plan = frozenset((_shape(share.select_rows), tuple(sorted(_shape(rows) or () for _, rows in share.copy_groups)),
                      tuple(share.source_heads.shape), share.all_heads) for share in planner.shares.values())
    prefix = None if cache.prefix is None else tuple(
        (level.groups, level.width, tuple(level.members.shape), level.key_valid is None, level.all_rows_in_order)
        for level in cache.prefix.levels)
    policy_state = None if cache.policy_state is None else type(cache.policy_state).__name__  # model-level, or per row
    return (kind, tuple(keys.shape), keys.dtype, cache.q_heads, cache.kv_heads, cache.sel_heads, repr(cache.config),
            plan, prefix, policy_state, planner.dense_throughout)


def _shape(tensor: torch.Tensor | None) -> tuple | None:
    return None if tensor is None else tuple(tensor.shape)
