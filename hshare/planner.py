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
from typing import Callable

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


def _greedy_pairs(similarity: torch.Tensor, copies: int):
    """Algorithm 1's pairs in the order it takes them, batched over leading dims: `copies` times the most
    similar remaining pair (i, j < i) of each plane, yielded as ``(similarity [G], copier [G], source [G])``
    (G: the leading dims flattened), then row and column i removed. Ties go to the first pair in row-major
    order (smallest i, then smallest j)."""
    size = similarity.shape[-1]
    if not 0 <= copies <= max(size - 1, 0):
        raise ValueError(f"copies = {copies} is out of range for {size} nodes; accepted: 0..{size - 1}")
    lower = torch.ones(size, size, dtype=torch.bool, device=similarity.device).tril(-1)
    scores = torch.where(lower, similarity.float(), torch.full_like(similarity, EMPTY, dtype=torch.float32))
    scores = scores.reshape(-1, size, size).clone()
    rows = torch.arange(scores.shape[0], device=similarity.device)
    for _ in range(copies):
        best, flat = scores.flatten(1).max(-1)
        copier, target = flat // size, flat % size
        yield best, copier, target
        scores[rows, copier, :] = EMPTY
        scores[rows, :, copier] = EMPTY


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
    lead = similarity.shape[:-2]
    planes = math.prod(lead)
    source = torch.arange(size, device=similarity.device).repeat(planes, 1)
    rows = torch.arange(planes, device=similarity.device)
    for best, copier, target in _greedy_pairs(similarity, copies):
        if threshold is not None and bool((best < threshold).any()):
            break
        source[rows, copier] = target
    for _ in range(max(1, math.ceil(math.log2(max(size, 2))))):  # pointer jumping resolves chains
        source = source.gather(1, source)
    return source.reshape(*lead, size)


def budget_copies(head_similarity: torch.Tensor | None, layer_similarity: torch.Tensor | None, count: int, heads: int,
                  head_copies: int, layer_copies: int, scorings: float,
                  over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  held_out: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> tuple[list[int], int]:
    """How many heads of each sparse layer, and how many layers, copy under the "auto" planner's scoring
    budget (`PlannerConfig.scorings`).

    Each dimension's copies are Algorithm 1's, in its order (`greedy_sharing`); the two are merged by
    similarity: while more than `scorings` of the ``Ls x H`` (layer, head) pairs select, the next pair taken
    is the more similar of the next layer copy and the next head copy of any layer that still selects (ties:
    the layer). A head copy saves one selecting pair, a layer copy every pair of that layer that still selects.
    At most `head_copies` heads of a layer and `layer_copies` layers copy (the sharing ratios' bounds); the
    budget is met unless they stop it first. Host syncs: at plan time only.

    The similarity of the pair a greedy step takes is the largest of its candidates', so it overstates the
    pair's by the evidence's noise, the more the more candidates: a layer's head pairs are many (496 at 32
    heads) and each a mean over few rows, a layer copy's candidates few and each a mean over every head. With
    `held_out`, the copies are ordered by these similarities and the merge compares each copy's similarity on
    the held-out evidence instead (the same pair on other prefill rows), which the choice did not see.

    Args:
        head_similarity: ``[Ls, H, H]`` per sparse layer (None: no head copies).
        layer_similarity: ``[Ls, Ls]``, entry (i, j < i) the similarity of sparse layer i to j (None: no layer
            copies).
        count, heads: Ls sparse layers, H selection heads a layer.
        over_ranks: under tensor parallelism, the mean over the ranks (`HeadShard.mean_over_ranks`) of the head
            copies' similarities, so that every rank, holding the same layer similarities, counts the same copies
            (each rank then pairs its own heads).
        held_out: ``(head, layer)`` similarities of the same shapes on other evidence rows, what the merge
            compares (None: the ordering's own).

    Returns:
        ``(head copies per sparse layer [Ls], layer copies)``.
    """
    head_taken, copiers = _budget_merge(head_similarity, layer_similarity, count, heads, head_copies, layer_copies,
                                        scorings, over_ranks, held_out)
    return head_taken, len(copiers)


def _budget_merge(head_similarity: torch.Tensor | None, layer_similarity: torch.Tensor | None, count: int,
                  heads: int, head_copies: int, layer_copies: int, scorings: float,
                  over_ranks: Callable[[torch.Tensor], torch.Tensor] | None,
                  held_out: tuple[torch.Tensor | None, torch.Tensor | None] | None) -> tuple[list[int], list[int]]:
    """`budget_copies`, with the sparse-layer positions of the layers that copy (in the order taken) instead of
    their count."""
    head_copies = head_copies if head_similarity is not None else 0
    layer_copies = layer_copies if layer_similarity is not None else 0
    held_heads, held_layers = held_out if held_out is not None else (head_similarity, layer_similarity)
    layers = torch.arange(count, device=head_similarity.device) if head_copies else None
    # [head_copies][Ls]: the similarity of each layer's k-th head copy; [layer_copies]: each layer copy's and copier
    head_best = []
    if head_copies:
        head_best = torch.stack([held_heads[layers, copier, source]
                                 for _, copier, source in _greedy_pairs(head_similarity, head_copies)])
        head_best = (over_ranks(head_best) if over_ranks is not None else head_best).tolist()
    layer_pairs = list(_greedy_pairs(layer_similarity, layer_copies)) if layer_copies else []
    layer_best = [float(held_layers[copier[0], source[0]]) for _, copier, source in layer_pairs]
    layer_copier = [int(copier[0]) for _, copier, _ in layer_pairs]
    head_taken, copied, layers_taken = [0] * count, [False] * count, 0
    selecting, target = count * heads, scorings * count * heads
    while selecting > target + 1e-9:
        head_move = max(((head_best[head_taken[p]][p], -p) for p in range(count)
                         if not copied[p] and head_taken[p] < head_copies), default=None)
        layer_move = layer_best[layers_taken] if layers_taken < layer_copies else None
        if head_move is None and layer_move is None:
            break
        if layer_move is not None and (head_move is None or layer_move >= head_move[0]):
            copier = layer_copier[layers_taken]
            layers_taken += 1
            copied[copier] = True
            selecting -= heads - head_taken[copier]
        else:
            layer = -head_move[1]
            head_taken[layer] += 1
            selecting -= 1
    return head_taken, layer_copier[:layers_taken]


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

    def summary(self, sparse_layers: list[int]) -> dict[str, float]:
        """What the plan shares, averaged over its planes: ``layer_copies`` (sparse layers that copy another),
        ``head_copies`` (heads of the selecting layers that copy another) and ``selecting`` (the share of the
        sparse layers' (layer, selection head) pairs that score the whole context at a selection step)."""
        layers = torch.tensor(sparse_layers, device=self.layer_source.device)
        selecting_layer = self.layer_source[:, layers] == layers  # [P, Ls]
        heads = self.head_source.shape[-1]
        own = self.head_source[layers] == torch.arange(heads, device=layers.device)  # [Ls, P, H]
        sources = own.sum(-1).T  # [P, Ls]
        pairs = (sources * selecting_layer).sum(-1).float()
        return {"layer_copies": float((~selecting_layer).sum(-1).float().mean()),
                "head_copies": float(((heads - sources) * selecting_layer).sum(-1).float().mean()),
                "selecting": float(pairs.mean()) / max(len(sparse_layers) * heads, 1)}


def identity_plan(num_layers: int, heads: int, device: torch.device) -> SharingPlan:
    return SharingPlan(
        layer_source=torch.arange(num_layers, device=device)[None],
        head_source=torch.arange(heads, device=device).repeat(num_layers, 1, 1),
    )


def build_plan(head_sim: dict[int, torch.Tensor], layer_sim: dict[int, torch.Tensor], sparse_layers: list[int],
               num_layers: int, heads: int, layer_ratio: float, head_ratio: float, per_sample: bool, batch: int,
               device: torch.device, random_generator: torch.Generator | None = None,
               threshold: float | None = None, scorings: float | None = None,
               over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
               halves: tuple[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]], ...] | None = None
               ) -> SharingPlan:
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
        scorings: the "auto" planner's scoring budget instead (`budget_copies`), for a per-batch plan: the
            ratios bound the copies, and each layer's head copies and the layer copies are counted from the
            evidence, then paired by Algorithm 1.
        over_ranks: the mean over tensor-parallel ranks (`budget_copies`).
        halves: the evidence rows split in two, ``((head_sim, layer_sim), (head_sim, layer_sim))`` as the first
            two: with `scorings`, `budget_copies` orders each dimension's copies on the first half and merges them
            by their similarities on the second (held out); the copies are then paired on all rows.
    """
    planes = batch if per_sample else 1

    def random_like(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.rand(shape, generator=random_generator).to(device)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return x if per_sample else x.mean(0, keepdim=True)

    plan = identity_plan(num_layers, heads, device)
    layer_source = plan.layer_source.repeat(planes, 1)
    head_source = plan.head_source.repeat(1, planes, 1)
    count = len(sparse_layers)
    head_copies = heads - sources_for_ratio(head_ratio, heads)
    layer_copies = count - sources_for_ratio(layer_ratio, count)

    def heads_of(similarity: dict[int, torch.Tensor]) -> torch.Tensor:  # [Ls, P, H, H]
        return torch.stack([reduce(similarity[layer]) for layer in sparse_layers])

    def layers_of(similarity: dict[int, torch.Tensor]) -> torch.Tensor:  # [P, Ls, Ls]
        matrix = torch.zeros(planes, count, count, device=device)
        for position, layer in enumerate(sparse_layers[1:], start=1):
            matrix[:, position, :position] = reduce(similarity[layer])
        return matrix

    stacked = matrix = None
    if head_copies:
        stacked = random_like((count, planes, heads, heads)) if random_generator is not None else heads_of(head_sim)
    if layer_copies:
        matrix = random_like((planes, count, count)) if random_generator is not None else layers_of(layer_sim)

    per_layer_heads = [head_copies] * count
    if scorings is not None:
        if per_sample:
            raise ValueError("a scoring budget plans one batch (per_sample False); accepted: per_sample with "
                             "scorings None")
        order = (None if stacked is None else stacked[:, 0], None if matrix is None else matrix[0])
        held = None
        if halves is not None and random_generator is None:
            order, held = [(heads_of(head_half)[:, 0] if head_copies else None,
                            layers_of(layer_half)[0] if layer_copies else None) for head_half, layer_half in halves]
        per_layer_heads, copiers = _budget_merge(*order, count, heads, head_copies, layer_copies, scorings,
                                                 over_ranks, held)
        layer_copies = len(copiers)
        if layer_copies:  # the layers the merge counted copy (so the budget holds), each paired on every row
            allowed = torch.zeros(count, dtype=torch.bool, device=device)
            allowed[copiers] = True
            matrix = torch.where(allowed[None, :, None], matrix, torch.full_like(matrix, EMPTY))
    if head_copies:
        if threshold is None and scorings is None:
            head_source[sparse_layers] = greedy_sharing(stacked, head_copies)
        else:  # each layer its own count of copying heads
            for position, layer in enumerate(sparse_layers):
                head_source[layer] = greedy_sharing(stacked[position], per_layer_heads[position], threshold)
    if layer_copies:
        local_source = greedy_sharing(matrix, layer_copies, threshold)  # positions in sparse_layers
        layer_ids = torch.tensor(sparse_layers, device=device)
        layer_source[:, layer_ids] = layer_ids[local_source]
    return SharingPlan(layer_source=layer_source, head_source=head_source)
