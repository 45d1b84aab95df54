"""How close a sparse generation stays to dense decoding, and GSM8K answer checks.

A 135M model scores near the floor on GSM8K, so the demo reports agreement with dense decoding
(the quantity sparse attention can change) next to accuracy.
"""

from __future__ import annotations

import re

import torch

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def token_agreement(generated: torch.Tensor, reference: torch.Tensor, pad_token_id: int | None = None) -> float:
    """Fraction of reference tokens that the generation reproduces at the same position.

    Args:
        generated, reference: ``[B, T]`` new tokens (T may differ: the shorter one is padded).
        pad_token_id: tokens after a row's end in the reference are not counted.
    """
    width = max(generated.shape[1], reference.shape[1])
    generated = torch.nn.functional.pad(generated, (0, width - generated.shape[1]), value=-1)
    reference = torch.nn.functional.pad(reference, (0, width - reference.shape[1]), value=-1)
    counted = reference != -1
    if pad_token_id is not None:
        counted &= reference != pad_token_id
    return float(((generated == reference) & counted).sum() / counted.sum().clamp(min=1))


def common_prefix_tokens(generated: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean number of leading new tokens identical to the reference (until the first divergence)."""
    width = min(generated.shape[1], reference.shape[1])
    same = (generated[:, :width] == reference[:, :width]).long()
    return float(same.cumprod(-1).sum(-1).float().mean())


def gsm8k_gold(answer: str) -> str | None:
    """The number after ``####`` in a GSM8K answer."""
    if "####" not in answer:
        return None
    return answer.split("####")[-1].strip().replace(",", "")


def last_number(text: str) -> str | None:
    """The last number in a generated answer (lm-eval's flexible-extract rule)."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value
