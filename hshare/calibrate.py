"""Offline heavy-channel calibration (DoubleSparse, as HShare uses it; section 4.2).

Runs the model over blocks of a text corpus and accumulates, per layer, query head and channel,
the mean of ``|q_c * k_c|`` (post-RoPE, same position) over *all* blocks (the public script
overwrote the statistic at every block, so only the last block counted).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hshare.channels import (ChannelCalibration, bundled_calibration_dir, calibration_file_name, channel_statistic,
                             model_signature, user_calibration_dir)
from hshare.patches import adapter_for, head_dim

_RECORDER = "hshare_calibration"


def calibrate(model, tokenizer, text: str, blocks: int = 16, block_tokens: int = 512,
              name: str | None = None, progress=None) -> ChannelCalibration:
    """Heavy-channel statistic of `model` over `blocks` consecutive blocks of `text`."""
    adapter_for(model)
    config = model.config
    total = torch.zeros(config.num_hidden_layers, config.num_attention_heads, head_dim(config), dtype=torch.float64)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    usable = min(blocks, ids.numel() // block_tokens)
    if usable == 0:
        raise ValueError(f"the calibration text has {ids.numel()} tokens; accepted: at least {block_tokens}")

    def record(module, query, key, value, attention_mask, **kwargs):
        valid = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
        total[module.layer_idx] += channel_statistic(query, key, valid).sum(0).double().cpu()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_RECORDER, record)
    previous = config._attn_implementation
    model.set_attn_implementation(_RECORDER)
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            for block in range(usable):
                chunk = ids[block * block_tokens:(block + 1) * block_tokens][None].to(device)
                model(chunk, use_cache=False)
                if progress is not None:
                    progress(block + 1, usable)
    finally:
        model.set_attn_implementation(previous)
    tokens = usable * block_tokens
    return ChannelCalibration(
        model=name or getattr(config, "_name_or_path", "") or config.model_type,
        signature=model_signature(config),
        statistic=(total / tokens).float(),
        tokens=tokens,
    )


def calibrate_to_file(model, tokenizer, text_path: str | Path, out_path: str | Path, **kwargs) -> ChannelCalibration:
    calibration = calibrate(model, tokenizer, Path(text_path).read_text(encoding="utf-8"), **kwargs)
    calibration.save(out_path)
    return calibration


def default_calibration_path(name: str) -> Path:
    """Where ``hshare calibrate`` writes a model's calibration: the bundled ``configs/channels``
    folder when it is writable (an editable install), else the user folder; `find_calibration`
    looks in both."""
    bundled = bundled_calibration_dir()
    folder = bundled if os.access(bundled, os.W_OK) else user_calibration_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / calibration_file_name(name)
