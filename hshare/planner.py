"""Layer and head sharing configuration (HShare Algorithm 1, section 4.3), vectorized.

Evidence: the *keep-sets* (heavy columns) that decode-time selection would choose for the last
prefill query rows of every layer and selection head, computed with the same label scores and
middle windows as decode (not a different statistic). Similarity of i to j (j < i) is the mean,
over evidence rows, of ``|keep_i & keep_j| / |keep_i|``; for layers it is also averaged over heads
(head h of a copying layer uses head h of its source).

Greedy (Algorithm 1): k times, take the most similar pair (i, j < i), let i copy j, remove row and
column i. A node that copies is never a source afterwards; a source may later copy an earlier
node, so chains i -> j -> m are resolved to i -> m. Ties go to the first pair in row-major order
(smallest i, then smallest j). Everything is batched tensor work (no loop over pairs, no sync).

Tensor parallelism (`hshare.heads`): a rank holds a slice of the heads, and its keep-sets, head
similarities and plan cover those heads only: head sharing is planned per rank (round(b * H_rank)
sources among the rank's heads; a head never copies another rank's head, so a decode step needs no
collective). Layer similarity is averaged over all ranks' heads at prefill, so every rank holds the
single-process layer plan (up to float rounding of the mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EMPTY = -1.0  # similarity of pairs that may not be chosen (similarities are in [0, 1])


def sources_for_ratio(ratio: float, count: int) -> int:
    """Number of selecting (source) nodes for a sharing ratio: round(ratio * count), at least 1."""
    return max(1, min(count, int(math.floor(ratio * count + 0.5))))


def keep_mask(keep: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., k]`` columns (-1 = none) -> ``[..., n]`` bool membership."""
    mask = torch.zeros((*keep.shape[:-1], n + 1), dtype=torch.bool, device=keep.device)
    mask.scatter_(-1, torch.where(keep >= 0, keep, torch.full_like(keep, n)).long(), True)
    return mask[..., :n]


def head_similarity(keep: torch.Tensor, n: int) -> torch.Tensor:
    """Similarity between the selection heads of one layer.

    Args:
        keep: ``[B, H, W, k]`` keep-sets of W evidence rows (-1 = none).
        n: number of key columns.

    Returns:
        ``[B, H, H]`` float32, entry (i, j) = mean over rows of |keep_i & keep_j| / |keep_i|.
    """
    mask = keep_mask(keep, n).float()  # [B, H, W, n]
    overlap = torch.einsum("biwn,bjwn->bijw", mask, mask)
    size = mask.sum(-1).clamp(min=1)  # [B, H, W]
    return (overlap / size[:, :, None, :]).mean(-1)


def layer_overlaps(keep_layer: torch.Tensor, keep_earlier: list[torch.Tensor], n: int) -> torch.Tensor:
    """Similarity of one layer to each earlier layer (head h to head h).

    Args:
        keep_layer: ``[B, H, W, k]`` keep-sets of layer i.
        keep_earlier: keep-sets of layers j < i, each ``[B, H, W, k]``.

    Returns:
        ``[B, len(keep_earlier)]`` float32: mean over heads and rows of |keep_i & keep_j| / |keep_i|.
    """
    batch = keep_layer.shape[0]
    if not keep_earlier:
        return torch.zeros(batch, 0, device=keep_layer.device)
    mask = keep_mask(keep_layer, n)  # [B, H, W, n]
    size = mask.sum(-1).clamp(min=1).float()
    earlier = torch.stack(keep_earlier)  # [j, B, H, W, k]
    hits = mask[None].expand(earlier.shape[0], *mask.shape).gather(-1, earlier.clamp(min=0).long())
    overlap = (hits & (earlier >= 0)).sum(-1).float()  # [j, B, H, W]
    return (overlap / size).mean(dim=(2, 3)).transpose(0, 1)


def greedy_sharing(similarity: torch.Tensor, copies: int, threshold: float | None = None) -> torch.Tensor:
    """Algorithm 1 with chain resolution, batched over leading dims.

    Args:
        similarity: ``[..., N, N]``; only entries (i, j) with j < i are used.
        copies: k, the number of nodes that copy another (0 <= k <= N - 1).
        threshold: when given (the "auto" planner), at most `copies` nodes copy: the greedy stops at the
            first pair below `threshold` in any of the leading dims, so every one takes the same number of
            copies (one host sync per pair taken).

    Returns:
        ``[..., N]`` int64 source of each node (itself for a source); always a source, and
        ``source[i] <= i``.
    """
    size = similarity.shape[-1]
    if not 0 <= copies <= max(size - 1, 0):
        raise ValueError(f"copies = {copies} is out of range for {size} nodes; accepted: 0..{size - 1}")
    lead = similarity.shape[:-2]
    device = similarity.device
    lower = torch.ones(size, size, dtype=torch.bool, device=device).tril(-1)
    scores = torch.where(lower, similarity.float(), torch.full_like(similarity, EMPTY, dtype=torch.float32))
    scores = scores.reshape(-1, size, size).clone()
    source = torch.arange(size, device=device).repeat(scores.shape[0], 1)
    rows = torch.arange(scores.shape[0], device=device)
    for _ in range(copies):
        best, flat = scores.flatten(1).max(-1)
        if threshold is not None and bool((best < threshold).any()):
            break
        copier, target = flat // size, flat % size
        source[rows, copier] = target
        scores[rows, copier, :] = EMPTY
        scores[rows, :, copier] = EMPTY
    for _ in range(max(1, math.ceil(math.log2(max(size, 2))))):  # pointer jumping resolves chains
        source = source.gather(1, source)
    return source.reshape(*lead, size)


@dataclass
class SharingPlan:
    """Who selects and who copies, for every sparse layer (per batch or per sample).

    Attributes:
        layer_source: ``[P, L]`` source layer of each layer (itself, an earlier sparse layer; dense
            layers map to themselves). P = 1 (per-batch plan) or B (per sample).
        head_source: ``[L, P, H]`` source selection head of each head.
    """

    layer_source: torch.Tensor
    head_source: torch.Tensor

    @property
    def per_sample(self) -> bool:
        return self.layer_source.shape[0] > 1

    def select_rows(self, rows: torch.Tensor) -> "SharingPlan":
        """The plan of a reordered batch (beam search); a per-batch plan is unchanged."""
        if not self.per_sample:
            return self
        return SharingPlan(self.layer_source[rows], self.head_source[:, rows])


def identity_plan(num_layers: int, heads: int, device: torch.device) -> SharingPlan:
    return SharingPlan(
        layer_source=torch.arange(num_layers, device=device)[None],
        head_source=torch.arange(heads, device=device).repeat(num_layers, 1, 1),
    )


def build_plan(head_sim: dict[int, torch.Tensor], layer_sim: dict[int, torch.Tensor], sparse_layers: list[int],
               num_layers: int, heads: int, layer_ratio: float, head_ratio: float, per_sample: bool, batch: int,
               device: torch.device, random_generator: torch.Generator | None = None,
               threshold: float | None = None) -> SharingPlan:
    """Plan layer and head sharing from prefill evidence.

    Args:
        head_sim: layer -> ``[B, H, H]`` head similarities (`head_similarity`).
        layer_sim: layer -> ``[B, i]`` similarities to the sparse layers before it, in
            `sparse_layers` order (`layer_overlaps`).
        sparse_layers: the layers that decode sparsely, ascending.
        per_sample: plan each row separately instead of summing the evidence over the batch.
        random_generator: when given, the evidence is ignored and similarities are random numbers
            (the paper's random-sharing ablation: same ratios and constraints).
        threshold: the "auto" planner's similarity target: the ratios bound the copies, and a pair below
            it never shares (`greedy_sharing`); head sharing is then chosen per layer.
    """
    planes = batch if per_sample else 1

    def random_like(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.rand(shape, generator=random_generator).to(device)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return x if per_sample else x.mean(0, keepdim=True)

    plan = identity_plan(num_layers, heads, device)
    layer_source = plan.layer_source.repeat(planes, 1)
    head_source = plan.head_source.repeat(1, planes, 1)

    head_copies = heads - sources_for_ratio(head_ratio, heads)
    if head_copies:
        if random_generator is not None:
            stacked = random_like((len(sparse_layers), planes, heads, heads))
        else:
            stacked = torch.stack([reduce(head_sim[layer]) for layer in sparse_layers])  # [Ls, P, H, H]
        if threshold is None:
            head_source[sparse_layers] = greedy_sharing(stacked, head_copies)
        else:  # each layer its own count of copying heads
            for position, layer in enumerate(sparse_layers):
                head_source[layer] = greedy_sharing(stacked[position], head_copies, threshold)

    count = len(sparse_layers)
    layer_copies = count - sources_for_ratio(layer_ratio, count)
    if layer_copies:
        if random_generator is not None:
            matrix = random_like((planes, count, count))
        else:
            matrix = torch.zeros(planes, count, count, device=device)
            for position, layer in enumerate(sparse_layers[1:], start=1):
                matrix[:, position, :position] = reduce(layer_sim[layer])
        local_source = greedy_sharing(matrix, layer_copies, threshold)  # positions in sparse_layers
        layer_ids = torch.tensor(sparse_layers, device=device)
        layer_source[:, layer_ids] = layer_ids[local_source]
    return SharingPlan(layer_source=layer_source, head_source=head_source)
