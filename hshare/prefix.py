"""Shared-prefix detection and the column layout of a batch whose prefix is stored once.

Two levels (Hydragen section 3.3, made automatic): level 1 is the longest common prefix of all
rows' unpadded prompts; level 2 groups rows (anywhere in the batch) whose prompts share a longer
prefix, e.g. the samples of one question after a few-shot prefix common to all questions. Each
row keeps at least its last prompt token as its own part (the prefill must feed every row).

The batch handed to transformers' ``generate`` is laid out ``[level 1 | level 2 | gap | own]``:

* level 1: ``W1`` columns, the same tokens in every row (stored once);
* level 2: ``W2`` columns, the row's group extension, right-padded to the longest group;
* gap: padding up to the longest own part;
* own: the row's remaining prompt tokens (then the generated ones).

Position ids are the cumulative sum of the attention mask (transformers' rule), so RoPE positions
equal those of the original left-padded batch; the padding sits between the levels and the own
part. The prefix columns are held by the cache's `PrefixStore`; the model only ever prefills the
own part for the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedPrefix:
    """What `detect_shared_prefix` found, on unpadded prompts.

    Attributes:
        common: level-1 length (0 = none).
        groups: level 2, ``(rows, extension length)`` per group of >= 2 rows sharing
            ``common + extension`` tokens.
    """

    common: int
    groups: list[tuple[list[int], int]]

    @property
    def empty(self) -> bool:
        return self.common == 0 and not self.groups


@dataclass
class PrefixLayout:
    """A batch laid out ``[level 1 | level 2 | gap | own]`` (module docstring).

    Attributes:
        input_ids, attention_mask: ``[B, n']`` the batch handed to ``generate``.
        level_tokens: per level ``[G, W]`` its groups' tokens (right-padded).
        level_valid: per level ``[G, W]`` bool, or None when every group fills the width.
        row_groups: per level ``[B]`` each row's group (``-1`` = in no group of the level).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    level_tokens: list[torch.Tensor]
    level_valid: list[torch.Tensor | None]
    row_groups: list[torch.Tensor]

    @property
    def widths(self) -> list[int]:
        return [tokens.shape[1] for tokens in self.level_tokens]


def _common_length(a: torch.Tensor, b: torch.Tensor, cap: int) -> int:
    """Length of the common prefix of two 1-D token tensors, at most `cap`."""
    cap = max(0, min(cap, len(a), len(b)))
    differs = (a[:cap] != b[:cap]).nonzero()
    return int(differs[0]) if len(differs) else cap


def detect_shared_prefix(prompts: list[torch.Tensor], min_tokens: int, min_rows: int, levels: int,
                         min_saved: int = 0) -> SharedPrefix:
    """Prefix levels of a batch of unpadded prompts.

    Args:
        prompts: B 1-D int tensors (the rows' tokens without padding).
        min_tokens: shortest level-1 prefix and shortest level-2 extension worth storing once.
        min_rows: fewest rows that must share level 1 (level-2 groups need >= max(2, min_rows)).
        levels: 1 or 2.
        min_saved: fewest token reads a level must save per step: (rows - 1) x its length.

    Returns:
        `SharedPrefix`; every row keeps at least one own token.
    """
    batch = len(prompts)
    cap = min(len(p) for p in prompts) - 1
    common = cap
    for prompt in prompts[1:]:
        common = _common_length(prompts[0], prompt, common)
    if common < min_tokens or batch < min_rows or (batch - 1) * common < min_saved:
        common = 0
    groups: list[tuple[list[int], int]] = []
    if levels >= 2 and batch >= 2:
        rests = [p[common:].tolist() for p in prompts]
        order = sorted(range(batch), key=lambda r: rests[r])  # rows sharing a prefix become neighbours
        run, run_length = [order[0]], None

        def close() -> None:
            if len(run) >= max(2, min_rows) and (len(run) - 1) * run_length >= min_saved:
                groups.append((sorted(run), run_length))

        for prev, cur in zip(order, order[1:]):
            extension = _common_length(prompts[prev][common:], prompts[cur][common:],
                                       min(len(prompts[prev]), len(prompts[cur])) - 1 - common)
            if extension >= min_tokens:
                run.append(cur)
                run_length = extension if run_length is None else min(run_length, extension)
            else:
                close()
                run, run_length = [cur], None
        close()
    return SharedPrefix(common, groups)


def build_layout(prompts: list[torch.Tensor], shared: SharedPrefix, pad_token_id: int) -> PrefixLayout:
    """The ``[level 1 | level 2 | gap | own]`` batch of `prompts` (module docstring)."""
    batch = len(prompts)
    device = prompts[0].device
    row_group2 = [-1] * batch
    extension = [0] * batch
    for group, (rows, length) in enumerate(shared.groups):
        for row in rows:
            row_group2[row], extension[row] = group, length
    level2_width = max((length for _, length in shared.groups), default=0)
    own = [prompt[shared.common + extension[r]:] for r, prompt in enumerate(prompts)]
    own_width = max(len(o) for o in own)
    width = shared.common + level2_width + own_width
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch, width), dtype=torch.long, device=device)
    level_tokens, level_valid, row_groups = [], [], []
    if shared.common:
        input_ids[:, :shared.common] = prompts[0][:shared.common]
        mask[:, :shared.common] = 1
        level_tokens.append(prompts[0][None, :shared.common])
        level_valid.append(None)
        row_groups.append(torch.zeros(batch, dtype=torch.long, device=device))
    if shared.groups:
        tokens = torch.full((len(shared.groups), level2_width), pad_token_id, dtype=torch.long, device=device)
        valid = torch.zeros((len(shared.groups), level2_width), dtype=torch.bool, device=device)
        for group, (rows, length) in enumerate(shared.groups):
            tokens[group, :length] = prompts[rows[0]][shared.common:shared.common + length]
            valid[group, :length] = True
        level_tokens.append(tokens)
        level_valid.append(None if bool(valid.all()) else valid)
        row_groups.append(torch.tensor(row_group2, dtype=torch.long, device=device))
    for row in range(batch):
        start = shared.common
        length = extension[row]
        input_ids[row, start:start + length] = prompts[row][start:start + length]
        mask[row, start:start + length] = 1
        input_ids[row, width - len(own[row]):] = own[row]
        mask[row, width - len(own[row]):] = 1
    return PrefixLayout(input_ids, mask, level_tokens, level_valid, row_groups)


def unpadded_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's tokens where the mask is 1 (left or right padding alike)."""
    return [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
