"""The cache's store of shared prefix levels: each level's keys and values held once per group.

Level ``l`` holds, per layer, ``[G_l, Hkv, W_l, d]`` keys and values (prefilled once, batch G_l)
and maps every row of the batch to its group (`row_group`, ``-1`` = none). While level ``l`` is
being prefilled the "rows" of the forward pass are that level's groups; the levels below it are
visible to them through the group of any member row.
"""

from __future__ import annotations

import torch

from hshare.kernels import PrefixKV, merge_attention_states, shared_decode_attention, shared_prefix_attention, \
    shared_prefix_decode_states


def group_membership(row_group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Members of each group and each row's slot among them.

    Args:
        row_group: ``[B]`` group of each row, ``-1`` = none.
        groups: G.

    Returns:
        ``(members [G, M] rows padded with -1, row_slot [B] = g * M + m or -1)``.
    """
    device = row_group.device
    host = row_group.cpu()
    counts = torch.bincount(host[host >= 0], minlength=groups)
    width = max(1, int(counts.max())) if groups else 1
    members = torch.full((groups, width), -1, dtype=torch.long)
    row_slot = torch.full_like(host, -1)
    filled = [0] * groups
    for row, group in enumerate(host.tolist()):
        if group >= 0:
            members[group, filled[group]] = row
            row_slot[row] = group * width + filled[group]
            filled[group] += 1
    return members.to(device), row_slot.to(device)


class PrefixLevel:
    """One level: G groups of W columns, stored once per group.

    Args:
        row_group: ``[B]`` each row's group, ``-1`` = none.
        key_valid: ``[G, W]`` bool for groups shorter than W, or None.
        num_layers: layers of the model.
    """

    def __init__(self, row_group: torch.Tensor, key_valid: torch.Tensor | None, groups: int, width: int,
                 num_layers: int) -> None:
        self.groups, self.width = groups, width
        self.key_valid = key_valid
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.set_rows(row_group)

    def set_rows(self, row_group: torch.Tensor) -> None:
        self.row_group = row_group
        self.members, self.row_slot = group_membership(row_group, self.groups)
        rows = len(row_group)
        self.all_rows_in_order = (self.groups == 1 and self.members.shape[1] == rows
                                  and bool((self.members[0] == torch.arange(rows, device=row_group.device)).all()))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


class PrefixStore:
    """All prefix levels of one generation (levels are prefilled in order, then frozen)."""

    def __init__(self, levels: list[PrefixLevel]) -> None:
        self.levels = levels
        self.filling: int | None = None  # the level being prefilled, None once all are stored
        self._pass_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._read_tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def width(self) -> int:
        """Columns of all levels (what the cache adds to each row's own length)."""
        return sum(level.width for level in self.levels)

    def start(self, level: int) -> int:
        return sum(lv.width for lv in self.levels[:level])

    def begin_fill(self, level: int) -> None:
        """Prefill of `level`: its groups are the rows; lower levels map them by a member row."""
        self.filling = level
        first_member = self.levels[level].members[:, 0]
        self._pass_rows = [group_membership(lower.row_group[first_member], lower.groups)
                           for lower in self.levels[:level]]

    def end_fill(self) -> None:
        self.filling = None
        self._pass_rows = []

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the prefilled keys/values ``[G, Hkv, W, d]`` of the level being filled."""
        level = self.levels[self.filling]
        if keys.shape[0] != level.groups or keys.shape[2] != level.width:
            raise ValueError(f"prefix level {self.filling} expects {level.groups} groups x {level.width} tokens, "
                             f"got keys of shape {tuple(keys.shape)}")
        level.keys[layer], level.values[layer] = keys, values
        return keys, values

    def select_rows(self, rows: torch.Tensor) -> None:
        """Rows of the batch were reordered / selected / repeated: remap their groups."""
        for level in self.levels:
            level.set_rows(level.row_group.index_select(0, rows.to(level.row_group.device)))
        self._read_tokens = None

    def read_tokens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix-level tokens one layer's decode attention reads per KV head, and what the rows would
        read without sharing: ``(valid tokens summed over the groups that have rows, valid tokens summed
        over the rows' groups)``, int64 device scalars summed over the levels (built once per layout,
        with tensor ops only)."""
        if self._read_tokens is None:
            read = seen = torch.zeros((), dtype=torch.int64, device=device)
            for level in self.levels:
                row_group = level.row_group.to(device)
                member = row_group >= 0
                group = row_group.clamp(min=0)
                tokens = (torch.full((level.groups,), level.width, dtype=torch.int64, device=device)
                          if level.key_valid is None else level.key_valid.to(device).sum(-1))
                rows = torch.zeros(level.groups, dtype=torch.int64, device=device).scatter_add_(0, group, member.long())
                read = read + (tokens * (rows > 0)).sum()
                seen = seen + (tokens[group] * member).sum()
            self._read_tokens = (read, seen)
        return self._read_tokens

    def attend(self, layer: int, query: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Exact attention of the pass's rows (prefill) over every visible level, merged by LSE.

        Args:
            query: ``[B, Hq, T, d]``.

        Returns:
            ``(out [B, Hq, T, d], lse [B, Hq, T])``, or None when no level is visible.
        """
        visible = self.levels if self.filling is None else self.levels[:self.filling]
        merged = None
        for index, level in enumerate(visible):
            kv = self.level_kv(level, layer)
            if self.filling is not None:  # the pass's rows are the filled level's groups
                kv = kv._replace(members=self._pass_rows[index][0], row_slot=self._pass_rows[index][1])
            part = shared_prefix_attention(query, kv.keys, kv.values, scale, kv.members, kv.row_slot, kv.key_valid)
            merged = part if merged is None else merge_attention_states(*merged, *part)
        return merged

    def decode_attention(self, layer: int, query: torch.Tensor, scale: float, keys: torch.Tensor,
                         values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode: exact attention over every level and the rows' own columns, merged by LSE.

        Level 1 runs in one pass with the own part (`shared_decode_attention`); further levels
        enter that pass as unmerged split states (`shared_prefix_decode_states`).

        Args:
            query: ``[B, Hq, d]``.
            keys, values: ``[B, Hkv, n, d]`` the rows' own cache; indices ``[B, H_sel, N_c]`` the own
                columns attended (all valid ones, or the sparse selection), ``-1`` = none.

        Returns:
            ``(out [B, Hq, d], lse [B, Hq])``.
        """
        first, *others = [self.level_kv(level, layer) for level in self.levels]
        partial = None
        if others:
            states = [shared_prefix_decode_states(query, kv.keys, kv.values, scale, kv.members, kv.row_slot, kv.key_valid)
                      for kv in others]
            partial = (torch.cat([out for out, _ in states], dim=2), torch.cat([lse for _, lse in states], dim=2))
        return shared_decode_attention(query, first, keys, values, indices, scale, partial)

    @staticmethod
    def level_kv(level: PrefixLevel, layer: int) -> PrefixKV:
        if level.all_rows_in_order:  # level 1: every row, in order: no gathers
            return PrefixKV(level.keys[layer], level.values[layer], key_valid=level.key_valid)
        return PrefixKV(level.keys[layer], level.values[layer], level.members, level.row_slot, level.key_valid)

    def nbytes(self) -> int:
        return sum(level.nbytes() for level in self.levels)
