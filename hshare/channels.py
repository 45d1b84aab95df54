"""Heavy channels: which r channels of q and k the labels keep (DoubleSparse offline calibration).

A calibration file holds, per layer and query head, the mean over calibration tokens of
``|q_c * k_c|`` (post-RoPE, q and k at the same position) for every channel c: the channels that
carry most of q . k. Selection heads take the top-r channels of that statistic (summed over the
query heads of a KV head when selection is per KV head).

Without a file the choice is *dynamic*: the same statistic over each row's own prompt at prefill
(``|q_c|`` weighted by ``|k_c|``), per row, so a row's labels do not depend on its batch mates.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from hshare.kernels import channel_statistic
from hshare.patches import head_dim


def model_signature(model_config) -> str:
    """Shape signature that ties a calibration file to a model architecture."""
    heads = model_config.num_attention_heads
    return (
        f"{model_config.model_type}-L{model_config.num_hidden_layers}-H{heads}-KV{model_config.num_key_value_heads}"
        f"-D{head_dim(model_config)}-hidden{model_config.hidden_size}-vocab{model_config.vocab_size}"
    )


@dataclass
class ChannelCalibration:
    """Per-(layer, query head, channel) statistic ``mean |q_c k_c|`` from a calibration corpus.

    Attributes:
        model: name of the calibrated model.
        signature: `model_signature` of its config.
        statistic: ``[L, Hq, d]`` float32.
        tokens: number of calibration tokens the statistic averages.
    """

    model: str
    signature: str
    statistic: torch.Tensor
    tokens: int

    def channels(self, layer: int, kv_heads: int, selection: str, count: int) -> torch.Tensor:
        """``[1, H_sel, count]`` int64 channels of one layer's selection heads (`kv_heads` KV heads
        over the statistic's query heads)."""
        stat = self.statistic[layer]  # [Hq, d]
        if selection == "kv_head":
            stat = stat.reshape(kv_heads, -1, stat.shape[-1]).sum(1)
        return stat.topk(count, dim=-1).indices.sort(-1).values[None]

    def head_slice(self, start: int, q_heads: int) -> "ChannelCalibration":
        """The statistic of query heads ``[start, start + q_heads)`` only (a tensor-parallel rank's
        heads, `hshare.heads.HeadShard`): ``statistic`` ``[L, q_heads, d]``, same signature."""
        if start < 0 or start + q_heads > self.statistic.shape[1]:
            raise ValueError(f"query heads {start}..{start + q_heads - 1} are outside the calibration's "
                             f"{self.statistic.shape[1]} heads ({self.signature})")
        return dataclasses.replace(self, statistic=self.statistic[:, start:start + q_heads])

    def save(self, path: str | Path) -> None:
        payload = {
            "model": self.model,
            "signature": self.signature,
            "tokens": self.tokens,
            "statistic": [[[round(float(v), 6) for v in head] for head in layer] for layer in self.statistic],
        }
        Path(path).write_text(json.dumps(payload))

    @classmethod
    def load(cls, path: str | Path) -> "ChannelCalibration":
        payload = json.loads(Path(path).read_text())
        return cls(
            model=payload["model"],
            signature=payload["signature"],
            statistic=torch.tensor(payload["statistic"], dtype=torch.float32),
            tokens=int(payload["tokens"]),
        )


def bundled_calibration_dir() -> Path:
    return Path(str(resources.files("hshare.configs"))) / "channels"


def user_calibration_dir() -> Path:
    """Calibrations written by ``hshare calibrate`` when the bundled folder is not writable:
    ``$HSHARE_CACHE/channels`` (default ``~/.cache/hshare/channels``)."""
    return Path(os.environ.get("HSHARE_CACHE", Path.home() / ".cache" / "hshare")) / "channels"


def model_name(model_config) -> str:
    """The model's name as calibration files record it: the last part of its path or hub id."""
    path = str(getattr(model_config, "_name_or_path", "") or "").rstrip("/")
    return path.rsplit("/", 1)[-1] or model_config.model_type


def calibration_file_name(name: str) -> str:
    """``configs/channels/<name>.json``: the model name, lowercased, with other characters as ``-``."""
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-") + ".json"


def find_calibration(model_config) -> Path | None:
    """The calibration file for the model: in the user folder, then the bundled one, a file named
    after the model whose signature matches, else any file whose signature matches."""
    signature = model_signature(model_config)
    wanted = calibration_file_name(model_name(model_config))
    matching = []
    for folder in (user_calibration_dir(), bundled_calibration_dir()):
        for path in sorted(folder.glob("*.json")):
            with open(path) as f:
                head = f.read(4096)
            if f'"signature": "{signature}"' in head:
                matching.append(path)
    named = [p for p in matching if p.name == wanted]
    return (named or matching or [None])[0]


def resolve_calibration(heavy_channels: str, model_config) -> ChannelCalibration | None:
    """The calibration to use for `LabelsConfig.heavy_channels` ('auto', 'dynamic' or a path)."""
    if heavy_channels == "dynamic":
        return None
    path = find_calibration(model_config) if heavy_channels == "auto" else Path(heavy_channels)
    if path is None:
        return None
    calibration = ChannelCalibration.load(path)
    if calibration.signature != model_signature(model_config):
        raise ValueError(
            f"calibration file {path} was made for {calibration.signature}, but the model is "
            f"{model_signature(model_config)}; accepted: a file calibrated on this architecture, 'auto' or 'dynamic'"
        )
    return calibration


def dynamic_channels(query: torch.Tensor, keys: torch.Tensor, token_valid: torch.Tensor, selection: str,
                     count: int) -> torch.Tensor:
    """Per-row heavy channels from the prompt itself: ``[B, H_sel, count]`` int64."""
    stat = channel_statistic(query, keys, token_valid)
    if selection == "kv_head":
        kv_heads = keys.shape[1]
        stat = stat.reshape(stat.shape[0], kv_heads, -1, stat.shape[-1]).sum(2)
    return stat.topk(count, dim=-1).indices.sort(-1).values
