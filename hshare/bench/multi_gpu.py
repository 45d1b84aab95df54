"""``hshare bench generate`` on several GPUs: where the model is placed, and what each process measures.

Two placements besides one device (`Placement`):

* tensor parallelism, ``--tp N``: run under torchrun, one process a GPU::

      torchrun --standalone --nproc-per-node N -m hshare.cli bench generate --tp N [...]

  (``-m hshare`` where ``hshare/__main__.py`` exists; over several nodes: torchrun's ``--nnodes`` /
  ``--rdzv-endpoint`` instead of ``--standalone``).
  Every rank builds the random-weight model directly sharded on its GPU (`build_tp_model`:
  transformers' ``tp_plan="auto"`` on a model made from a config, weights made on the GPUs, nothing
  read or written), generates from the same prompts (rank 0's, broadcast), and measures its own GPU;
  rank 0 gathers every rank's numbers (`gather`), prints and writes the JSON. ``--tp N`` outside
  torchrun stops with the command to run (`require_torchrun`): the bench does not relaunch itself.
* accelerate's ``device_map``, ``--device-map auto|balanced|sequential|splitN`` (one process): the
  model built and dispatched over the visible GPUs (`build_device_map_model`; ``splitN``: the layers
  cut into N contiguous parts, one a GPU, `split_device_map`). hshare's sparse presets refuse such a
  model by name (``hshare.api.refuse_split_placement``): the bench records the library's message as
  the row's error (`split_refusal`) and goes on.

Peak memory is per GPU (``torch.cuda.max_memory_allocated`` of each GPU the process uses: its own
under TP, each GPU of the map under ``device_map``); rows keep the list and its maximum.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "sequential")  # accelerate's own, passed to from_pretrained as is


@dataclass(frozen=True)
class Placement:
    """Where the benchmarked model lives: one device, ``tp`` tensor-parallel ranks, or a ``device_map``."""

    tp: int = 1
    device_map: str | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp {self.tp}: accepted: a number of ranks >= 1")
        if self.tp > 1 and self.device_map:
            raise ValueError("--tp and --device-map exclude each other (transformers refuses tp_plan with a "
                             "device_map); accepted: one of them")
        if self.device_map is not None:
            split_parts(self.device_map)  # validates the spec

    @property
    def label(self) -> str:
        """What rows and titles show: "" on one device, "tp2", "device_map split2"."""
        if self.tp > 1:
            return f"tp{self.tp}"
        return f"device_map {self.device_map}" if self.device_map else ""

    @property
    def tag(self) -> str:
        """The results file's suffix: "", "_tp2", "_dm-split2"."""
        if self.tp > 1:
            return f"_tp{self.tp}"
        return f"_dm-{self.device_map}" if self.device_map else ""


def split_parts(spec: str) -> int | None:
    """The N of ``splitN`` (None for accelerate's strategies); raises on anything else."""
    if spec in DEVICE_MAP_STRATEGIES:
        return None
    match = re.fullmatch(r"split(\d+)", spec)
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"--device-map {spec!r}: accepted: {', '.join(DEVICE_MAP_STRATEGIES)}, or splitN (the "
                         "layers in N contiguous parts, one a GPU)")
    return int(match.group(1))


# ---- processes ----
def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world() -> int:
    return dist.get_world_size() if distributed() else 1


def require_torchrun(tp: int) -> None:
    """Stop unless this process is one of `tp` started by torchrun (and not one of several without ``--tp``)."""
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1 and ranks != tp:
        where = "outside torchrun" if "WORLD_SIZE" not in os.environ else f"under torchrun with {ranks} processes"
        raise SystemExit(f"--tp {tp} runs one process a GPU under torchrun ({where} here); run:\n"
                         f"  torchrun --standalone --nproc-per-node {tp} -m hshare.cli bench generate --tp {tp} ...")
    if tp == 1 and ranks > 1:
        raise SystemExit(f"hshare bench generate under torchrun ({ranks} processes) without --tp: each process would "
                         f"run the whole bench on its own; accepted: --tp {ranks}")


def gather(obj) -> list:
    """`obj` of every rank, in rank order (``[obj]`` in one process)."""
    if not distributed():
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if distributed():
        dist.barrier()


def finish() -> None:
    """End the process group (NCCL warns at exit otherwise)."""
    if distributed():
        dist.destroy_process_group()


def broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank (the same prompts everywhere); `tensor` itself in one process."""
    if distributed():
        dist.broadcast(tensor, src=0)
    return tensor


# ---- building the model ----
@contextlib.contextmanager
def _quiet_loading():
    """from_pretrained without a checkpoint reports every weight MISSING (newly initialized): that is the point."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _from_config(model_class, config, dtype: torch.dtype, **placement):
    """A random-weight model of `config` placed by transformers' loader: ``from_pretrained`` with no
    checkpoint and an empty state dict, so the model is made on the meta device, placed (sharded for
    TP, dispatched for a device map) and every weight initialized where it lives. Nothing is read or
    written, and no process holds the whole model on the CPU."""
    torch.manual_seed(0)  # every rank: the same replicated weights
    with _quiet_loading():
        model = model_class.from_pretrained(None, config=config, state_dict={}, dtype=dtype, **placement)
    return model.eval()


def build_tp_model(model_class, config, dtype: torch.dtype, tp: int):
    """The model sharded over the `tp` torchrun ranks by transformers' ``tp_plan="auto"`` (Llama's and Mistral's
    ``base_model_tp_plan``: q/k/v/gate/up column-wise, o/down row-wise with an all-reduce after each, two a layer;
    the head column-wise with its logits all-gathered; the embedding replicated)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig
        placement = dict(tp_plan="auto", tp_size=tp)
    else:
        placement = dict(distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp))
    kv_heads = config.num_key_value_heads
    if kv_heads % tp:
        raise SystemExit(f"--tp {tp} does not divide the {kv_heads} KV heads of the shape; accepted: a divisor of "
                         f"{kv_heads}")
    model = _from_config(model_class, config, dtype, **placement)
    if (getattr(model, "tp_size", None) or 1) != tp:
        raise RuntimeError(f"transformers built the model with tp_size={getattr(model, 'tp_size', None)}, not {tp}")
    return model


def split_device_map(num_layers: int, devices: list) -> dict:
    """Contiguous layer blocks, one a device (the first ones one layer longer where they do not divide),
    the embedding and rotary table with the first block, the final norm and head with the last."""
    parts = len(devices)
    mapping = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    start = 0
    for part, device in enumerate(devices):
        size = num_layers // parts + (part < num_layers % parts)
        mapping.update({f"model.layers.{i}": device for i in range(start, start + size)})
        start += size
    mapping.update({"model.norm": devices[-1], "lm_head": devices[-1]})
    return mapping


def build_device_map_model(model_class, config, dtype: torch.dtype, spec: str, device: str):
    """The model dispatched by accelerate over the visible GPUs: ``spec`` is one of accelerate's strategies
    (``auto``: balanced over the GPUs), or ``splitN`` (`split_device_map` over GPUs 0..N-1). `device`
    "cpu" (smoke) puts every part on the CPU."""
    parts = split_parts(spec)
    if device != "cuda":
        device_map = split_device_map(config.num_hidden_layers, ["cpu"] * (parts or 1))
    elif parts is None:
        device_map = spec
    else:
        if parts > torch.cuda.device_count():
            raise SystemExit(f"--device-map {spec}: {torch.cuda.device_count()} GPU(s) visible")
        device_map = split_device_map(config.num_hidden_layers, list(range(parts)))
    return _from_config(model_class, config, dtype, device_map=device_map)


def split_refusal(model, path: str, overrides: dict | None) -> str | None:
    """The library's refusal of preset `path` on this model's placement (a sparse preset on a model split over
    devices), or None. Asked of hshare itself (``refuse_split_placement``), before anything is generated."""
    if path in ("unpatched", "static"):
        return None
    from hshare.api import refuse_split_placement
    from hshare.config import resolve_config

    try:
        config = resolve_config(path, **(overrides or {}))
    except Exception:  # noqa: BLE001 - not a preset: the path's run fails and its row says why
        return None
    try:
        refuse_split_placement(model, config)
    except ValueError as refusal:
        return str(refusal)
    return None


# ---- measuring ----
def model_gpus(model) -> list[torch.device]:
    """The CUDA devices this process's part of the model lives on (none on CPU)."""
    if not torch.cuda.is_available():
        return []
    mapping = getattr(model, "hf_device_map", None) or {}
    devices = set()
    for where in mapping.values():
        if isinstance(where, int):
            devices.add(torch.device("cuda", where))
        elif isinstance(where, (str, torch.device)) and str(where).startswith("cuda"):
            device = torch.device(where)
            devices.add(torch.device("cuda", device.index if device.index is not None else 0))
    if not devices and model.device.type == "cuda":
        devices.add(torch.device("cuda", model.device.index if model.device.index is not None
                                 else torch.cuda.current_device()))
    return sorted(devices, key=lambda d: d.index)


def synchronize(gpus: list[torch.device]) -> None:
    for gpu in gpus:
        torch.cuda.synchronize(gpu)


def reset_peaks(gpus: list[torch.device]) -> None:
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)


def peaks_gib(gpus: list[torch.device]) -> list[float]:
    return [torch.cuda.max_memory_allocated(gpu) / 2**30 for gpu in gpus]


def describe_gpus(gpus: list[torch.device]) -> list[str]:
    return [f"{gpu}: {torch.cuda.get_device_name(gpu)}" for gpu in gpus]
