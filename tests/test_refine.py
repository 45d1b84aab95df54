"""Candidate-set refinement (`SharingConfig.candidates`, `hshare.refine`) against brute force: a reusing step,
head or layer keeps the top `heavy` of its own label scores restricted to its source's candidates, with
the sink and local windows; the counters count the candidate rows it scores."""

import pytest
import torch

import hshare
import hshare.attention as attention_module
from hshare import static_decode
from hshare.config import ConfigError, HShareConfig, resolve_config
from hshare.kernels import candidate_label_scores, decode_label_scores, quantize_labels
from hshare.policy import SelectionPolicy
from hshare.refine import refine_by_keys, select_candidates
from hshare.selection import with_successors
from hshare.selection import NO_TOKEN

from conftest import cache_kwarg, greedy, left_pad, left_padded, tiny_llama
from property_support import check_successor_walk
from test_label_topk import valid_candidates, window_case

SMALL = dict(sink=2, local=4, heavy=6)  # N_c = 12
LENGTHS = [40, 27, 51]
NEW = 10


def _label_cache(batch=3, sel_heads=2, kv_heads=2, q_heads=4, n=30, dim=16, r=8, bits=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, n, dim, generator=generator)
    channels = torch.stack([torch.randperm(dim, generator=generator)[:r] for _ in range(sel_heads)])[None]
    kv_of_sel = torch.arange(sel_heads) * kv_heads // sel_heads
    picked = keys[:, kv_of_sel].gather(-1, channels[:, :, None].expand(batch, -1, n, -1))
    codes, scale, zero = quantize_labels(picked, bits)
    query = torch.randn(batch, q_heads, dim, generator=generator)
    return query, channels, codes, scale, zero, bits


def _as_set(columns):
    return {int(c) for c in columns if c >= 0}


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_candidate_scores_equal_the_full_scores_at_the_candidates(bits):
    query, channels, codes, scale, zero, bits = _label_cache(bits=bits)
    full = decode_label_scores(query, channels, codes, scale, zero, bits)  # [B, H, n]
    columns = torch.randint(0, full.shape[-1], (3, 2, 7))
    got = candidate_label_scores(query, channels, codes, scale, zero, bits, columns)
    torch.testing.assert_close(got, full.gather(-1, columns))
    rows, heads = torch.tensor([2, 0]), torch.tensor([[1], [0]])  # per-row heads
    full = decode_label_scores(query, channels, codes, scale, zero, bits, rows, heads)
    columns = torch.randint(0, full.shape[-1], (2, 1, 5))
    got = candidate_label_scores(query, channels, codes, scale, zero, bits, columns, rows, heads)
    torch.testing.assert_close(got, full.gather(-1, columns))


class TablePolicy(SelectionPolicy):
    """Scores by a fixed table ``[B, H, n]``: brute force is a sort of the table. `scoring` = "all" scores every
    column only (the default `candidate_scores` gathers them), "candidates" scores candidates alone."""

    unit = "tokens"

    def __init__(self, table, scoring):
        self.table, self.scoring = table, scoring
        self.scores_candidates = scoring == "candidates"

    def _table(self, rows, heads):
        table = self.table if rows is None else self.table[rows]
        if heads is not None:
            table = table.gather(1, heads.expand(table.shape[0], -1)[..., None].expand(-1, -1, table.shape[-1]))
        return table

    def decode_scores(self, query, rows=None, heads=None):
        assert self.scoring == "all", "a candidate-scoring policy scores the full width only to pick candidates"
        return self._table(rows, heads)

    def decode_heavy(self, query, selectable, heavy, rows=None, heads=None):
        from hshare.selection import select_heavy
        return select_heavy(self._table(rows, heads), selectable[:, None], heavy)

    def candidate_scores(self, query, columns, rows=None, heads=None):
        return self._table(rows, heads).gather(-1, columns.clamp(min=0))

    from_prefill = add_keys = score_query = prefill_scores = None


@pytest.mark.parametrize("scoring", ["all", "candidates"])
def test_select_candidates_is_the_top_c_and_its_top_heavy(scoring):
    policy = TablePolicy(torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(3)), scoring)
    window = torch.zeros(2, 40, dtype=torch.bool)
    window[0, 5:30], window[1, 2:9] = True, True  # row 1: fewer selectable columns than C
    bounds = torch.tensor([[5, 30], [2, 9]])
    for rows, heads in ((None, None), (torch.tensor([1, 0]), torch.tensor([[2, 0]]))):
        picked = window if rows is None else window[rows]
        heavy, candidates = select_candidates(policy, None, picked, bounds if rows is None else bounds[rows], 10, 4,
                                              rows, heads)
        table = policy._table(rows, heads)
        for b in range(table.shape[0]):
            for h in range(table.shape[1]):
                allowed = picked[b].nonzero().flatten()
                ranked = allowed[table[b, h, allowed].argsort(descending=True)].tolist()
                assert _as_set(candidates[b, h]) == set(ranked[:10])
                assert _as_set(heavy[b, h]) == set(ranked[:4])
        short = 1 if rows is None else 0
        assert (candidates[short] == NO_TOKEN).sum() == 3 * table.shape[1]


def test_with_successors_by_hand():
    columns = torch.tensor([[[5, 2, 3, 9], [9, 0, 1, 8], [7, NO_TOKEN, 2, 9], [4, 1, NO_TOKEN, NO_TOKEN]]])
    scores = torch.tensor([[[4.0, 3.0, 2.0, 1.0], [1.0, 4.0, 3.0, 2.0], [1.0, 5.0, 2.0, 3.0], [0.0, -0.0, 7.0, 7.0]]])
    window = torch.ones(1, 10, dtype=torch.bool)
    window[0, 6] = False
    got, best = with_successors(columns, scores, window, 2)
    assert got.tolist() == [[  # the walk's set, ascending
        [2, 3, 4, 5],  # 5 (its successor 6 outside the window), 2 and 3, then 3 is taken: its successor 4
        [0, 1, 2, 8],  # 0 and 1, then 1 is taken: 2; 8 fills the last slot without its successor 9
        [2, 3, 7, 9],  # NO_TOKEN never ranks: 9 (10 is past the last column), 2 and 3, then 7
        [1, 2, 4, 5],  # a tie (0.0 and -0.0): the smaller column first
    ]]
    assert best.tolist() == [[[2, 5], [0, 1], [2, 9], [1, 4]]]  # the two best given columns, ascending
    fewer = torch.tensor([[[NO_TOKEN, NO_TOKEN, 3]]])
    got, best = with_successors(fewer, torch.zeros(1, 1, 3), window, 2)
    assert got.tolist() == [[[3, 4, NO_TOKEN]]] and best.tolist() == [[[3, NO_TOKEN]]]


def test_with_successors_is_the_brute_force_walk():
    generator = torch.Generator().manual_seed(11)
    for draw in range(30):
        n, k = int(torch.randint(4, 40, (1,), generator=generator)), int(torch.randint(1, 5, (1,), generator=generator))
        k = min(k * 3, n)
        columns = torch.stack([torch.randperm(n, generator=generator)[:k] for _ in range(6)]).reshape(2, 3, k)
        columns[columns % 5 == 4] = NO_TOKEN  # holes
        if draw % 3 == 0:  # a run of adjacent columns, the rest distinct from it
            run = torch.arange(n // 2 - 2, n // 2 - 2 + min(k, 4))
            rest = torch.randperm(n, generator=generator)
            columns[0, 0] = torch.cat((run, rest[~torch.isin(rest, run)]))[:k]
        scores = (torch.randint(-2, 3, (2, 3, k), generator=generator).float() if draw % 2  # ties
                  else torch.randn(2, 3, k, generator=generator))
        window = torch.rand(2, n, generator=generator) > 0.3
        top = int(torch.randint(0, k + 1, (1,), generator=generator))
        check_successor_walk(columns, scores, window, with_successors(columns, scores, window, top))


def _with_successors_brute_force(ranked: list[int], count: int, window: torch.Tensor) -> set[int]:
    """The top `count` of `ranked` walked in order: each column unless kept, then its successor in `window` unless
    kept, until `count` are kept."""
    kept: list[int] = []
    for c in ranked[:count]:
        for column in (c, c + 1):
            if len(kept) < count and column not in kept and (column == c or (column < len(window) and window[column])):
                kept.append(column)
    return set(kept)


@pytest.mark.parametrize("scoring", ["all", "candidates"])
@pytest.mark.parametrize("count", [10, 9])
def test_select_candidates_with_successors(scoring, count):
    policy = TablePolicy(torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(4)), scoring)
    window = torch.zeros(2, 40, dtype=torch.bool)
    window[0, 5:30], window[1, 2:9] = True, True
    window[0, 17] = False  # a hole: no successor there
    heavy, candidates = select_candidates(policy, None, window, torch.tensor([[5, 30], [2, 9]]), count, 4,
                                          successors=True)
    for b in range(2):
        for h in range(3):
            allowed = window[b].nonzero().flatten()
            ranked = allowed[policy.table[b, h, allowed].argsort(descending=True)].tolist()
            assert _as_set(candidates[b, h]) == _with_successors_brute_force(ranked, count, window[b])
            assert _as_set(heavy[b, h]) == set(ranked[:4])  # its own top heavy


def test_refinement_is_the_brute_force_top_k_within_the_candidates():
    generator = torch.Generator().manual_seed(5)
    policy = TablePolicy(torch.randn(3, 2, 50, generator=generator), "candidates")
    valid, bounds, window = window_case(3, 50, generator)  # the window as bounds, and its mask (the reference)
    candidates = valid_candidates(valid, 2, 12, generator)
    candidates[2, 1, 9:] = NO_TOKEN
    refined = policy.candidate_heavy(None, candidates, bounds, 5)
    for b in range(3):
        for h in range(2):
            inside = [int(c) for c in candidates[b, h] if c >= 0 and window[b, c]]
            ranked = sorted(inside, key=lambda c: -float(policy.table[b, h, c]))
            assert _as_set(refined[b, h]) == set(ranked[:5])
            assert (refined[b, h] >= 0).sum() == min(5, len(inside))
    rows, heads = torch.tensor([1, 2]), torch.tensor([[1]])
    refined = policy.candidate_heavy(None, candidates[rows][:, 1:], bounds[rows], 5, rows=rows, heads=heads)
    for i, b in enumerate(rows.tolist()):
        inside = [int(c) for c in candidates[b, 1] if c >= 0 and window[b, c]]
        ranked = sorted(inside, key=lambda c: -float(policy.table[b, 1, c]))
        assert _as_set(refined[i, 0]) == set(ranked[:5])


def _exact_logits(query, keys):
    """fp64 ``[B, Hkv, n]``: each column's q . k summed over the KV head's query group (brute force)."""
    batch, q_heads, dim = query.shape
    grouped = query.double().reshape(batch, keys.shape[1], q_heads // keys.shape[1], dim).sum(2)
    return torch.einsum("bhd,bhnd->bhn", grouped, keys.double())


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_refine_by_keys_is_the_exact_top_k_within_the_candidates(monkeypatch, kernels):
    """`refine_by_keys`: the top `heavy` candidates in the window by exact logits (GQA: summed over the group), for
    all rows and heads, some rows and heads, and in place for some heads (`out`); fp32 keys (the twin), or bf16 keys
    through the Triton candidate kernel (interpreted on CPU) against the same brute force."""
    from test_label_topk import DEVICE, triton_or_skip

    if kernels == "triton":
        triton_or_skip()
    monkeypatch.setenv("HSHARE_KERNELS", kernels)
    generator = torch.Generator().manual_seed(11)
    dtype = torch.float32 if kernels == "torch" else torch.bfloat16
    keys = torch.randn(3, 2, 40, 16, generator=generator).to(dtype)  # [B, Hkv, n, d]
    query = torch.randn(3, 4, 16, generator=generator).to(dtype)  # GQA: 2 query heads a KV head
    valid, bounds, window = window_case(3, 40, generator)
    candidates = valid_candidates(valid, 2, 14, generator)
    candidates[1, 0, 10:] = NO_TOKEN
    logits = _exact_logits(query.float(), keys.float())
    on_device = refine_by_keys(keys.to(DEVICE))

    def refine(query, candidates, window, heavy, rows=None, heads=None, out=None):  # on the kernels' device
        moved = [None if t is None else t.to(DEVICE) for t in (query, candidates, window, rows, heads, out)]
        got = on_device(moved[0], moved[1], moved[2], heavy, *moved[3:])
        if out is not None:
            out.copy_(got.cpu())
            return out
        return got.cpu()

    def expected(b, h, count):
        inside = [int(c) for c in candidates[b, h] if c >= 0 and window[b, c]]
        return set(sorted(inside, key=lambda c: -float(logits[b, h, c]))[:count])

    got = refine(query, candidates, bounds, 5)
    assert got.shape == (3, 2, 5)
    for b in range(3):
        for h in range(2):
            assert _as_set(got[b, h]) == expected(b, h, 5)
            assert int((got[b, h] >= 0).sum()) == len(expected(b, h, 5))
    rows, heads = torch.tensor([2, 0]), torch.tensor([[1]])
    got = refine(query, candidates[rows][:, 1:], bounds[rows], 6, rows=rows, heads=heads)
    for i, b in enumerate(rows.tolist()):
        assert _as_set(got[i, 0]) == expected(b, 1, 6)
    out = torch.full((3, 2, 4), 99, dtype=torch.long)
    some = torch.tensor([[1], [0], [1]])  # per row, the head that refines its own entry
    assert refine(query, candidates, bounds, 4, heads=some, out=out) is out
    for b in range(3):
        h = int(some[b, 0])
        assert _as_set(out[b, h]) == expected(b, h, 4) and bool((out[b, 1 - h] == 99).all())


def test_config():
    assert HShareConfig(heavy=88, candidates=2).candidate_count == 176
    assert HShareConfig(heavy=88).candidate_count == 0  # off
    assert HShareConfig(heavy=0, local=40, candidates=2).candidate_count == 0  # nothing to refine
    for bad in (0.5, True, "2", 100):
        with pytest.raises(ConfigError, match="candidates"):
            HShareConfig(candidates=bad)
    assert HShareConfig.from_preset("hshare-refine").sharing.candidates > 1
    assert HShareConfig.from_preset("hshare-refine-successors").sharing.successors
    wide = HShareConfig.from_preset("hshare-refine-successors-c4@2048")
    assert wide.sharing.successors and wide.candidate_count == 4 * 1968  # the Triton walk's limit holds it
    from hshare.kernels.label_topk_triton import MAX_WALK_CANDIDATES
    assert wide.candidate_count <= MAX_WALK_CANDIDATES
    assert HShareConfig(successors=True).candidate_count == 0  # successors of the heavy columns themselves
    with pytest.raises(ConfigError, match=r"successors = True with policy 'quest' is invalid.*accepted"):
        HShareConfig(policy="quest", successors=True)
    with pytest.raises(ConfigError, match=r"sharing.successors = 1 is invalid; accepted: true or false"):
        HShareConfig(candidates=2, successors=1)
    assert HShareConfig().sharing.refine_steps and not HShareConfig(refine_steps=False).sharing.refine_steps
    with pytest.raises(ConfigError, match=r"sharing.refine_steps = 'no' is invalid; accepted: true or false"):
        HShareConfig(candidates=2, refine_steps="no")
    assert HShareConfig().sharing.refine_by == "labels"
    assert HShareConfig(candidates=2, refine_by="keys").sharing.refine_by == "keys"
    assert HShareConfig.from_preset("dense").replace(refine_by="keys").sharing.refine_by == "keys"  # unused dense
    two_stage = HShareConfig.from_preset("ds-keys@512")
    assert (two_stage.sharing.refine_by, two_stage.candidate_count, two_stage.sharing.query_group) == ("keys", 1728, 1)
    with pytest.raises(ConfigError, match=r"sharing.refine_by = 'exact' is invalid.*accepted"):
        HShareConfig(candidates=2, refine_by="exact")
    with pytest.raises(ConfigError, match=r"refine_by = 'keys' without a candidate set is invalid.*accepted"):
        HShareConfig(refine_by="keys")
    with pytest.raises(ConfigError, match=r"refine_by = 'keys' with planner.selection = 'query_head' is invalid"):
        HShareConfig(candidates=2, refine_by="keys", selection="query_head")


def _prompts(prefix: str):
    """Left-padded random prompts; with a shared prefix of 30 tokens when `prefix` is "on"."""
    generator = torch.Generator().manual_seed(1)
    if prefix == "off":
        return left_padded(LENGTHS, generator)
    shared = torch.randint(3, 160, (30,), generator=generator)
    return left_pad([torch.cat((shared, torch.randint(3, 160, (n,), generator=generator))) for n in (20, 33, 26)])


def _record(monkeypatch) -> list[dict]:
    """What every sparse decode layer attends: its query, step, plan, selection and critical indices."""
    seen = []
    real_decode = attention_module._decode_attention

    def decode(cache, layer_idx, query, key, value, indices, scaling):
        layer, step = cache.layers[layer_idx], cache.planner.current
        seen.append(dict(layer=layer_idx, query=query[:, :, 0].clone(), key=key.clone(), kind=step.kind,
                         windows=step.windows,
                         share=step.shares[layer_idx], policy=layer.policy, indices=indices.clone(),
                         heavy=layer.heavy.clone(),
                         candidates=None if layer.candidates is None else layer.candidates.clone()))
        return real_decode(cache, layer_idx, query, key, value, indices, scaling)

    monkeypatch.setattr(attention_module, "_decode_attention", decode)
    return seen


@pytest.mark.parametrize("preset,prefix,overrides", [
    ("hshare-1_2-1_2-1_2", "off", {}),
    ("ds", "off", {}),
    ("hshare-1_2-1_2-1_2", "off", dict(plan_scope="sample", group_lookahead=True)),
    ("hshare-1_2-1_2-1_2", "on", {}),
    ("hshare-1_2-1_2-1_2", "off", dict(successors=True)),
    ("hshare-1_2-1_2-1_2", "on", dict(successors=True, group_lookahead=True)),
    ("ds", "on", dict(successors=True)),
    ("hshare-1_2-1_2-1_2", "off", dict(refine_by="keys")),
    ("hshare-1_2-1_2-1_2", "on", dict(refine_by="keys", successors=True)),
    ("ds", "off", dict(refine_by="keys")),
])
def test_every_reusing_layer_head_and_step_refines_with_its_own_query(monkeypatch, preset, prefix, overrides):
    """Brute force, per decode forward: a source (layer, head) at a selection step keeps the top C of its full
    label scores as candidates and the top `heavy` as heavy columns; a copying head or layer holds its
    source's candidates; every other (reuse steps, copying heads and layers) keeps the top `heavy` of its own
    query's full label scores among its candidates in the window; the attended indices are the sink, those
    heavy columns still in the middle window, and the local window. With ``refine_by="keys"`` every head,
    sources included, keeps the top `heavy` of its candidates by exact logits (the labels pick the candidates)."""
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = _prompts(prefix)
    seen = _record(monkeypatch)
    with hshare.patched(model, preset, candidates=2, query_sharing="1/2", dense_fallback_mib=0, prefix=prefix,
                        **SMALL, **overrides):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=NEW, **cache_kwarg(cache))
    assert (cache.prefix is not None) == (prefix == "on")
    heavy, count = SMALL["heavy"], 12
    checked = {"select": 0, "reuse": 0, "copied": 0}
    forward = {}
    for entry in seen:
        if entry["layer"] in forward:
            forward = {}
        forward[entry["layer"]] = entry
        policy, windows, share = entry["policy"], entry["windows"], entry["share"]
        full = policy.decode_scores(entry["query"])  # [B, H, n]
        exact = _exact_logits(entry["query"], entry["key"]) if overrides.get("refine_by") == "keys" else full
        selecting = entry["kind"] == "select"
        window = windows.selectable if selecting else windows.middle
        selects = torch.zeros(full.shape[0], dtype=torch.bool)
        if selecting:
            selects[:] = share.select_rows is None
            if share.select_rows is not None:
                selects[share.select_rows] = True
            for source, rows in share.copy_groups:  # a copying layer holds its source layer's candidates
                rows = slice(None) if rows is None else rows
                assert torch.equal(entry["candidates"][rows], forward[source]["candidates"][rows])
        for b in range(full.shape[0]):
            plane = b if share.source_heads.shape[0] > 1 else 0
            for h in range(full.shape[1]):
                candidates = entry["candidates"][b, h]
                head_source = int(share.source_heads[plane][share.head_slot[plane][h]])
                source_layer = bool(selects[b])
                if source_layer and head_source == h:
                    allowed = window[b].nonzero().flatten()
                    ranked = allowed[full[b, h, allowed].argsort(descending=True)].tolist()
                    if overrides.get("successors"):
                        assert _as_set(candidates) == _with_successors_brute_force(ranked, count, window[b])
                    else:
                        assert _as_set(candidates) == set(ranked[:count])
                    expected = set(ranked[:heavy])
                    if exact is not full:
                        inside = [int(c) for c in candidates if c >= 0 and window[b, c]]
                        expected = set(sorted(inside, key=lambda c: -float(exact[b, h, c]))[:heavy])
                    checked["select"] += 1
                else:
                    if source_layer:  # a copying head holds its source head's candidates
                        assert torch.equal(candidates, entry["candidates"][b, head_source])
                    inside = [int(c) for c in candidates if c >= 0 and window[b, c]]
                    ranked = sorted(inside, key=lambda c: -float(exact[b, h, c]))
                    expected = set(ranked[:heavy])
                    checked["copied" if selecting else "reuse"] += 1
                assert _as_set(entry["heavy"][b, h]) == expected
                if not windows.short[b]:
                    middle = windows.middle[b]
                    want = _as_set(windows.sink[b]) | _as_set(windows.local[b]) | {c for c in expected if middle[c]}
                    assert _as_set(entry["indices"][b, h]) == want
    assert checked["select"] and checked["reuse"]
    assert bool(checked["copied"]) == (preset != "ds")


@pytest.mark.parametrize("preset,prefix", [("hshare-1_2-1_2-1_2", "off"), ("hshare-7_8-3_4-1_2", "on"),
                                           ("ds", "off")])
def test_successors_without_refinement(monkeypatch, preset, prefix):
    """Brute force, per decode forward, with successors and no candidate set: a source (layer, head) at a
    selection step walks the top `heavy` of its full label scores in the window, keeping each with its
    successor until `heavy` are kept; a copying head holds its source head's columns, a copying layer its
    source layer's, a reuse step the columns of the step before."""
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = _prompts(prefix)
    seen = _record(monkeypatch)
    with hshare.patched(model, preset, successors=True, query_sharing="1/2", dense_fallback_mib=0, prefix=prefix,
                        **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=NEW, **cache_kwarg(cache))
    heavy = SMALL["heavy"]
    checked = {"select": 0, "copied": 0, "reuse": 0}
    forward, previous = {}, {}
    for entry in seen:
        layer = entry["layer"]
        if layer in forward:
            previous, forward = forward, {}
        forward[layer] = entry
        if entry["kind"] != "select":
            assert torch.equal(entry["heavy"], previous[layer]["heavy"])
            checked["reuse"] += 1
            continue
        share, window = entry["share"], entry["windows"].selectable
        full = entry["policy"].decode_scores(entry["query"])  # [B, H, n]
        copied = torch.zeros(full.shape[0], dtype=torch.bool)
        for source, rows in share.copy_groups:
            rows = slice(None) if rows is None else rows
            assert torch.equal(entry["heavy"][rows], forward[source]["heavy"][rows])
            copied[rows] = True
        for b in (~copied).nonzero().flatten().tolist():
            plane = b if share.source_heads.shape[0] > 1 else 0
            for h in range(full.shape[1]):
                head_source = int(share.source_heads[plane][share.head_slot[plane][h]])
                if head_source != h:
                    assert torch.equal(entry["heavy"][b, h], entry["heavy"][b, head_source])
                    checked["copied"] += 1
                    continue
                allowed = window[b].nonzero().flatten()
                ranked = allowed[full[b, h, allowed].argsort(descending=True)].tolist()
                assert _as_set(entry["heavy"][b, h]) == _with_successors_brute_force(ranked, heavy, window[b])
                checked["select"] += 1
    assert checked["select"] and checked["reuse"]
    assert bool(checked["copied"]) == (preset == "hshare-1_2-1_2-1_2")  # 3/4 of 2 heads rounds to 2


def test_plan_evidence_ranks_without_successors(monkeypatch):
    """The greedy plan's evidence with successors on: each (row, head, evidence row) keeps the top `heavy` of its
    prefill scores in its middle window (brute force), the ranking the plan pairs heads and layers by."""
    from hshare import prefill_metadata

    seen = {}
    real_select, real_middle, real_overlaps = (prefill_metadata.select_heavy, prefill_metadata.prefill_middle_windows,
                                               prefill_metadata.layer_overlaps)

    def select(scores, middle, k):
        seen["scores"], seen["top"] = scores.clone(), k
        return real_select(scores, middle, k)

    def middle_windows(*args):
        seen["middle"] = real_middle(*args)
        return seen["middle"]

    def overlaps(keep, earlier, n):
        seen.setdefault("checked", []).append((seen["scores"], seen["middle"], seen["top"], keep.clone()))
        return real_overlaps(keep, earlier, n)

    monkeypatch.setattr(prefill_metadata, "select_heavy", select)
    monkeypatch.setattr(prefill_metadata, "prefill_middle_windows", middle_windows)
    monkeypatch.setattr(prefill_metadata, "layer_overlaps", overlaps)
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(4))
    with hshare.patched(model, "hshare-successors", dense_fallback_mib=0, **SMALL):
        greedy(model, ids, mask, new_tokens=2, **cache_kwarg(hshare.new_cache(model)))
    heavy = SMALL["heavy"]
    assert len(seen["checked"]) == 4
    for scores, middle, top, keep in seen["checked"]:
        assert top == heavy
        batch, heads, rows, _ = scores.shape
        for b in range(batch):
            for w in range(rows):
                allowed = middle[b, w].nonzero().flatten()
                for h in range(heads):
                    ranked = allowed[scores[b, h, w, allowed].argsort(descending=True)].tolist()
                    assert _as_set(keep[b, h, w]) == set(ranked[:heavy])


def _refinements_brute_force(cache, steps: int) -> int:
    """Refinements of a generation of `steps` decode steps, counted from the plan and the schedule."""
    planner, rows, heads = cache.planner, cache.rows, cache.sel_heads
    group = cache.config.sharing.query_group
    total = 0
    for step in range(steps):
        if step % group:  # a reuse step: every sparse layer refines every (row, head), or none
            total += rows * heads * len(planner.shares) if cache.config.sharing.refine_steps else 0
            continue
        for share in planner.shares.values():
            selecting = rows if share.select_rows is None else len(share.select_rows)
            total += selecting * (heads - share.source_heads.shape[1]) + (rows - selecting) * heads
    return total


@pytest.mark.parametrize("preset", ["hshare-1_2-1_2-1_2", "hshare-7_8-3_4-1_2"])
def test_counters_count_the_candidate_rows_scored(preset):
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(1))
    stats = {}
    for candidates in (1, 2):
        with hshare.patched(model, preset, candidates=candidates, dense_fallback_mib=0, **SMALL):
            cache = hshare.new_cache(model)
            greedy(model, ids, mask, new_tokens=NEW, **cache_kwarg(cache))
            stats[candidates] = cache.stats
    plain, refined = stats[1], stats[2]
    assert plain.refinements == 0
    assert refined.score_computations == plain.score_computations and refined.selection_steps == plain.selection_steps
    assert refined.refinements == _refinements_brute_force(cache, NEW - 1) > 0
    # a scoring scores every cached column as before, then its C = 12 candidates again to pick its heavy among
    # them (the label policy scores candidates alone); a refinement its C = 12 candidates
    assert refined.scored_tokens == plain.scored_tokens + 12 * (refined.refinements + refined.score_computations)


@pytest.mark.parametrize("successors", [False, True])
def test_counters_count_the_key_rows_an_exact_refinement_scores(successors):
    """refine_by="keys": the same scorings and refinements; a selecting head's C candidates and each refinement's
    C are key rows (`scored_keys`), no longer label rows (with successors the walk still ranks the C by labels)."""
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(3))
    stats = {}
    for refine_by in ("labels", "keys"):
        with hshare.patched(model, "hshare-1_2-1_2-1_2", candidates=2, successors=successors, refine_by=refine_by,
                            dense_fallback_mib=0, **SMALL):
            cache = hshare.new_cache(model)
            greedy(model, ids, mask, new_tokens=NEW, **cache_kwarg(cache))
            stats[refine_by] = cache.stats
    labels, keys = stats["labels"], stats["keys"]
    assert (keys.score_computations, keys.refinements) == (labels.score_computations, labels.refinements)
    assert labels.refinements > 0 and labels.scored_keys == 0
    count = 12  # C = 2 x heavy
    assert keys.scored_keys == count * (keys.score_computations + keys.refinements)
    no_longer = count * keys.refinements + (0 if successors else count * keys.score_computations)
    assert keys.scored_tokens == labels.scored_tokens - no_longer


@pytest.mark.parametrize("prefix,successors", [("off", False), ("on", True)])
def test_reuse_steps_without_step_refinement_keep_the_selection_steps_columns(monkeypatch, prefix, successors):
    """`refine_steps=False`: a selection step is the same as with it (the same heavy columns and candidates
    at every layer), and each later step of the query group attends the columns its layer and head kept at
    that selection step (with the current step's sink, local and middle windows), refining nothing."""
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = _prompts(prefix)
    runs, caches = {}, {}
    for refine_steps in (True, False):
        seen = _record(monkeypatch)
        with hshare.patched(model, "hshare-1_2-1_2-1_2", candidates=2, query_sharing="1/3", dense_fallback_mib=0,
                            prefix=prefix, successors=successors, refine_steps=refine_steps, **SMALL):
            caches[refine_steps] = hshare.new_cache(model)
            greedy(model, ids, mask, new_tokens=NEW, **cache_kwarg(caches[refine_steps]))
        runs[refine_steps] = list(seen)
        monkeypatch.undo()
    refined, kept = runs[True], runs[False]
    first_reuse = next(i for i, entry in enumerate(kept) if entry["kind"] == "reuse")
    for a, b in zip(refined[:first_reuse], kept[:first_reuse]):  # identical up to the first reuse step
        assert a["kind"] == b["kind"] == "select" and torch.equal(a["heavy"], b["heavy"])
        assert torch.equal(a["candidates"], b["candidates"]) and torch.equal(a["indices"], b["indices"])
    selection = {}
    reused = 0
    for entry in kept:
        if entry["kind"] == "select":
            selection[entry["layer"]] = entry["heavy"]
            continue
        assert torch.equal(entry["heavy"], selection[entry["layer"]])
        windows = entry["windows"]
        for b in range(entry["heavy"].shape[0]):
            if windows.short[b]:
                continue
            middle = windows.middle[b]
            for h in range(entry["heavy"].shape[1]):
                want = _as_set(windows.sink[b]) | _as_set(windows.local[b]) | \
                    {int(c) for c in entry["heavy"][b, h] if c >= 0 and middle[c]}
                assert _as_set(entry["indices"][b, h]) == want
        reused += 1
    assert reused and selection
    for refine_steps, cache in caches.items():
        assert cache.stats.refinements == _refinements_brute_force(cache, NEW - 1) > 0
    assert caches[False].stats.refinements < caches[True].stats.refinements
    assert caches[False].stats.score_computations == caches[True].stats.score_computations


def test_counters_count_the_rows_successors_rank():
    """With successors the label policy's selecting head walks the scores its selection computed
    (`LabelCache.successor_rescorings`): no label row more than without successors. Without successors, with
    refinement, it picks its heavy among its C candidates by scoring them again: C rows a scoring more than with
    successors."""
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(2))
    stats = {}
    for candidates, successors in ((1, False), (1, True), (2, False), (2, True)):
        with hshare.patched(model, "hshare-1_2-1_2-1_2", candidates=candidates, successors=successors,
                            dense_fallback_mib=0, **SMALL):
            cache = hshare.new_cache(model)
            greedy(model, ids, mask, new_tokens=NEW, **cache_kwarg(cache))
            stats[candidates, successors] = cache.stats
    for candidates, fewer in ((1, 0), (2, 2 * SMALL["heavy"])):
        plain, walked = stats[candidates, False], stats[candidates, True]
        assert walked.score_computations == plain.score_computations > 0
        assert walked.scored_tokens == plain.scored_tokens - fewer * walked.score_computations


@pytest.mark.parametrize("overrides", [{}, dict(plan_scope="sample"), dict(query_sharing="1/4", group_lookahead=True),
                                       dict(successors=True), dict(successors=True, candidates=1),
                                       dict(successors=True, refine_steps=False), dict(refine_by="keys"),
                                       dict(successors=True, refine_by="keys")])
def test_static_shapes_equal_eager(monkeypatch, overrides):
    monkeypatch.setattr(static_decode, "STATIC_ON_CPU", True)
    model = tiny_llama(kv_heads=2, layers=4)
    ids, mask = left_padded([31, 18, 26, 9])
    out = {}
    for static in (False, True):
        with hshare.patched(model, "hshare-1_2-1_2-1_2", cuda_graphs=static, **{"candidates": 2, **SMALL, **overrides}):
            cache = hshare.new_cache(model)
            out[static] = (greedy(model, ids, mask, new_tokens=8, **cache_kwarg(cache)), cache)
    static_cache = out[True][1]
    assert static_cache.static_decode.reason == "" and static_cache.static_decode.eager_steps == 7
    assert torch.equal(out[True][0], out[False][0])
    assert static_cache.stats.refinements == out[False][1].stats.refinements
    assert (static_cache.stats.refinements > 0) == (static_cache.config.candidate_count > 0)


@pytest.mark.parametrize("refine_by", ["labels", "keys"])
def test_static_refinements_write_in_place_and_copying_layers_keep_their_sources_candidates(monkeypatch, refine_by):
    """With static shapes every refinement of every head writes its layer's kept heavy buffer in place (one buffer
    a layer for the whole generate), and a layer that copies for every row keeps its source layer's candidates
    themselves: nothing is copied a step. The tokens equal eager decoding's (above)."""
    monkeypatch.setattr(static_decode, "STATIC_ON_CPU", True)
    model = tiny_llama(kv_heads=2, layers=4)
    ids, mask = left_padded([31, 18, 26])
    buffers, in_place = {}, []
    refine = attention_module._refine

    def spy(cache, layer, refine_heads, *args):
        def recorded(*arguments, **options):
            refined = refine_heads(*arguments, **options)  # with the step's windows: (columns, critical indices)
            in_place.append((refined[0] if options.get("critical") else refined) is layer.heavy)
            return refined

        indices = refine(cache, layer, recorded, *args)
        buffers.setdefault(id(layer), set()).add(layer.heavy.data_ptr())
        return indices

    monkeypatch.setattr(attention_module, "_refine", spy)
    with hshare.patched(model, "hshare-refine-successors", cuda_graphs=True, refine_by=refine_by, **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=8, **cache_kwarg(cache))
    layers = cache.layers
    plan = cache.planner.sharing.layer_source[0].tolist()
    copying = [layer for layer, source in enumerate(plan) if source != layer]
    assert copying and len(buffers) == len(layers) and all(in_place)  # every layer refined (reuse steps) in place
    assert all(len(pointers) == 1 for pointers in buffers.values())
    assert all(buffers[id(layer)] == {layer.heavy.data_ptr()} for layer in layers)
    assert all(layers[layer].candidates is layers[plan[layer]].candidates for layer in copying)
    assert all(layers[layer].candidates is not layers[other].candidates
               for layer in range(len(layers)) for other in range(layer) if layer not in copying)


# ---- the "auto" planner: Algorithm 1 shares only pairs that reach the similarity target ----------------------

def _algorithm_1(similarity, copies, threshold):
    """Brute force: the most similar pair (i, j < i) at a time, while it reaches `threshold`."""
    size = len(similarity)
    source, alive = list(range(size)), set(range(size))
    for _ in range(copies):
        pairs = [(float(similarity[i][j]), -i, -j) for i in alive for j in alive if j < i]
        if not pairs:
            break
        best, i, j = max(pairs)
        if best < threshold:
            break
        source[-i] = -j
        alive.discard(-i)
    for i in range(size):
        while source[source[i]] != source[i]:
            source[i] = source[source[i]]
    return source


@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.8, 1.01])
def test_auto_greedy_stops_below_the_target(threshold):
    from hshare.planner import greedy_sharing

    generator = torch.Generator().manual_seed(7)
    for _ in range(5):
        similarity = torch.rand(6, 6, generator=generator)
        got = greedy_sharing(similarity, 4, threshold)
        assert got.tolist() == _algorithm_1(similarity.tolist(), 4, threshold)
    assert greedy_sharing(similarity, 4, 0.0).tolist() == greedy_sharing(similarity, 4).tolist()


def test_auto_planner_shares_per_the_evidence():
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(1))
    sources = {}
    for target in (0.0, 1.0):
        with hshare.patched(model, "hshare-1_2-1_2-1_2", planner="auto", share_similarity=target,
                            dense_fallback_mib=0, **SMALL):
            cache = hshare.new_cache(model)
            greedy(model, ids, mask, new_tokens=4, **cache_kwarg(cache))
            plan = cache.planner.sharing
            sources[target] = (int((plan.layer_source[0] == torch.arange(4)).sum()),
                               int((plan.head_source[:, 0] == torch.arange(2)).sum()))
    assert sources[0.0] == (2, 4)  # any pair reaches 0: the ratios' bound, 2 of 4 layers, 1 of 2 heads each
    assert sources[1.0] == (4, 8)  # no pair of this random model is identical: nothing shares


@pytest.mark.parametrize("scorings", [0.25, 0.5, 1.0])
def test_auto_planner_meets_a_scoring_budget(scorings):
    """`planner.scorings`: the plan's selecting (layer, head) pairs are within the budget (of 4 layers x 2 KV heads,
    bounds: one layer and one head a layer selecting), and each selection step scores exactly those pairs."""
    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(2))
    with hshare.patched(model, "hshare-1_2-1_2-1_2", planner="auto", share_scorings=scorings, layer_sharing="1/4",
                        head_sharing="1/2", dense_fallback_mib=0, **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=5, **cache_kwarg(cache))
    plan, stats = cache.planner.sharing, cache.stats
    selecting = sum(int((plan.head_source[layer, 0] == torch.arange(2)).sum()) for layer in range(4)
                    if int(plan.layer_source[0, layer]) == layer)
    assert scorings * 8 - 2 < selecting <= scorings * 8  # met, and a copy saves at most a layer's two pairs
    assert stats.score_computations == selecting * len(LENGTHS) * stats.selection_steps


def test_the_auto_preset_meets_its_budget_and_refines_the_shared_candidates():
    """`hshare-auto`: the C = 4 refinement with the auto planner under a scoring budget of 1/4. Of 8 layers x 4 heads
    (MHA) at most 8 pairs score the whole context (a copy saves at most a layer's 4), every selection step scores
    exactly those, and every other (layer, head) pair refines the candidates it shares at every sparse step."""
    model = tiny_llama(kv_heads=4, layers=8, heads=4)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(5))
    with hshare.patched(model, "hshare-auto", dense_fallback_mib=0, **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=5, **cache_kwarg(cache))
    plan, stats = cache.planner.sharing, cache.stats
    assert cache.config.planner.method == "auto" and cache.config.planner.scorings == 0.25
    assert cache.config.candidate_count == 4 * SMALL["heavy"] and cache.config.sharing.successors
    selecting = sum(int((plan.head_source[layer, 0] == torch.arange(4)).sum()) for layer in range(8)
                    if int(plan.layer_source[0, layer]) == layer)
    assert 8 - 4 < selecting <= 8
    assert stats.score_computations == selecting * len(LENGTHS) * stats.selection_steps
    # every pair refines at every sparse step but the selecting pairs at their selection steps
    assert stats.refinements == len(LENGTHS) * (32 * stats.sparse_steps - selecting * stats.selection_steps)


@pytest.mark.parametrize("rows,scorings", [(4, 0.5), (3, 0.5), (1, 0.5), (4, None)])
def test_a_scoring_budget_plans_on_halves_of_the_evidence(monkeypatch, rows, scorings):
    """Under a scoring budget with two evidence rows or more the planner hands `build_plan` each half's similarities
    (the even rows', the odd rows'): every sparse layer's head similarities, and its layer overlaps with the layers
    before it, those of `head_similarity` / `layer_overlaps` over the half's keep-sets; none with one row or without
    a budget."""
    from hshare import planner as planner_module
    from hshare import step as step_module

    model = tiny_llama(kv_heads=2, layers=4, heads=4)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(3))
    seen = {}
    build = step_module.build_plan

    def recording(*args, **kwargs):
        seen["halves"] = args[-1]
        seen["keep"] = dict(cache.planner.keep)
        return build(*args, **kwargs)

    monkeypatch.setattr(step_module, "build_plan", recording)
    options = dict(planner="auto", share_scorings=scorings) if scorings else dict(planner="auto")
    with hshare.patched(model, "hshare-1_2-1_2-1_2", plan_rows=rows, layer_sharing="1/2", head_sharing="1/2",
                        dense_fallback_mib=0, **options, **SMALL):
        cache = hshare.new_cache(model)
        greedy(model, ids, mask, new_tokens=3, **cache_kwarg(cache))
    if rows == 1 or scorings is None:
        assert seen["halves"] is None
        return
    keep, n = seen["keep"], cache.layers[0].keys.shape[2]
    for start, (heads_half, layers_half) in enumerate(seen["halves"]):
        assert sorted(heads_half) == [0, 1, 2, 3] and sorted(layers_half) == [0, 1, 2, 3]
        for layer in range(4):
            rows_half = keep[layer][:, :, start::2]
            assert rows_half.shape[2] == (rows + 1 - start) // 2
            assert torch.allclose(heads_half[layer], planner_module.head_similarity(rows_half, n))
            earlier = [keep[i][:, :, start::2] for i in range(layer)]
            assert torch.allclose(layers_half[layer], planner_module.layer_overlaps(rows_half, earlier, n))


def test_a_scoring_budget_is_refused_where_it_cannot_hold():
    with pytest.raises(ConfigError, match="method 'auto' with scorings"):
        resolve_config("hshare-1_2-1_2-1_2", share_scorings=0.5)
    with pytest.raises(ConfigError, match="unreachable.*0.25"):
        resolve_config("hshare-1_2-1_2-1_2", planner="auto", share_scorings=0.2)
    with pytest.raises(ConfigError, match="scope 'batch'"):
        resolve_config("hshare-1_2-1_2-1_2", planner="auto", share_scorings=0.5, plan_scope="sample")
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="scorings.*accepted"):
            resolve_config("hshare-1_2-1_2-1_2", planner="auto", share_scorings=bad)
    config = resolve_config("hshare-1_2-1_2-1_2", planner="auto", share_scorings="1/4")
    assert config.planner.scorings == 0.25
