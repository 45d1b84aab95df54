"""The selection-policy base class and registry: lookup, errors, and the storage mechanics every
policy inherits (select_rows, crop, freeze, thaw, nbytes, buffers), checked for each policy against
expectations computed from shapes and from the policy's own scores before the operation."""

from dataclasses import dataclass

import pytest
import torch

import hshare.policy as policy_module
from hshare.config import ConfigError, HShareConfig, PolicyConfig, resolve_config
from hshare.labels import LabelCache
from hshare.loki import LokiKeyCache
from hshare.policy import SelectionPolicy, new_policy, policy_class, policy_names, register_policy
from hshare.quest import QuestPageCache, pages_for

BATCH, KV_HEADS, Q_HEADS, DIM, PROMPT, DECODED, RESERVE = 3, 2, 4, 8, 21, 5, 30
PAGE, BITS, CHANNELS, RANK = 4, 8, 4, 3


def padded_keys(seed=0):
    """Left-padded float64 keys ``[B, Hkv, n, d]`` (prompts of 21, 9 and 14 tokens, then 5 decoded
    columns) and their validity ``[B, n]``."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(BATCH, KV_HEADS, PROMPT + DECODED, DIM, generator=gen, dtype=torch.float64)
    keys = keys * torch.linspace(3.0, 0.5, DIM, dtype=torch.float64)
    valid = torch.ones(BATCH, PROMPT + DECODED, dtype=torch.bool)
    for row, length in enumerate((21, 9, 14)):
        valid[row, :PROMPT - length] = False
    return keys, valid


def make_policy(name, keys, valid, selection="kv_head", reserve=RESERVE):
    """A policy of `name` made at a prefill of the first PROMPT columns (per-row channels for labels)."""
    sel_heads = KV_HEADS if selection == "kv_head" else Q_HEADS
    query = torch.randn(BATCH, Q_HEADS, PROMPT, DIM, generator=torch.Generator().manual_seed(1), dtype=keys.dtype)
    options = {"labels": dict(heavy_channels="dynamic", label_channels=CHANNELS, label_bits=BITS),
               "quest": dict(page_size=PAGE), "loki": dict(loki_rank=RANK)}[name]
    config = HShareConfig(policy=name, selection=selection, **options)
    made = new_policy(config, None, 0, query, keys[:, :, :PROMPT], valid[:, :PROMPT], KV_HEADS, reserve)
    assert type(made) is policy_class(name) and made.sel_heads == sel_heads
    return made


def filled(name, selection="kv_head", reserve=RESERVE, seed=0):
    """A policy holding the prompt (with validity) and DECODED decode appends, and the keys."""
    keys, valid = padded_keys(seed)
    policy = make_policy(name, keys, valid, selection, reserve)
    policy.append(keys[:, :, :PROMPT], valid[:, :PROMPT])
    for column in range(PROMPT, PROMPT + DECODED):
        policy.append(keys[:, :, column:column + 1])
    return policy, keys


def expected_nbytes(name, rows, columns, sel_heads=KV_HEADS):
    """Bytes of the metadata of `columns` columns of `rows` rows, from the layouts (float64 keys)."""
    if name == "labels":  # uint8 codes of r channels, float64 scale and zero per token and selection head
        return rows * sel_heads * columns * (CHANNELS * BITS // 8 + 2 * 8)
    if name == "quest":  # float64 min and max per page slot, KV head and channel
        return 2 * rows * KV_HEADS * pages_for(columns, PAGE) * DIM * 8
    return rows * KV_HEADS * columns * RANK * 8  # loki: float64 projections per column and KV head


def expected_slots(name, columns):
    """Slots of the first metadata buffer for `columns` columns: Quest's page slots, else the columns."""
    return pages_for(columns, PAGE) if name == "quest" else columns


def query_of(seed=2, rows=BATCH):
    return torch.randn(rows, Q_HEADS, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


POLICIES = ("labels", "loki", "quest")  # registration order


# ---- registry ----------------------------------------------------------------------------------

def test_every_config_policy_is_registered_and_looked_up():
    assert policy_names() == POLICIES
    assert (policy_class("labels"), policy_class("quest"), policy_class("loki")) == (LabelCache, QuestPageCache,
                                                                                  LokiKeyCache)
    assert all(policy_class(name).name == name and policy_class(name).supports_static for name in POLICIES)
    assert isinstance(QuestPageCache(2, 2, 16), SelectionPolicy)


def test_an_unknown_policy_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="unknown selection policy 'h2o'; accepted: 'labels', 'loki', 'quest'"):
        policy_class("h2o")
    with pytest.raises(ConfigError, match="policy = 'h2o' is invalid; accepted: 'labels', 'loki', 'quest'"):
        HShareConfig(policy="h2o")


def test_registration_checks_and_the_base_defaults(monkeypatch):
    monkeypatch.setattr(policy_module, "_REGISTRY", dict(policy_module._REGISTRY))

    @dataclass(frozen=True)
    class CountingConfig(PolicyConfig):
        """The policy's own section of the config."""
        weight: int = 1
        flat_names = {"counting_weight": "weight"}

    @register_policy("counting")
    class Counting(SelectionPolicy):
        """Scores a token by its column (a minimal policy: no static write, default describe)."""
        config_class = CountingConfig
        column_buffers = ("marks",)

        @classmethod
        def from_prefill(cls, config, calibration, layer, query, new_keys, new_valid, kv_heads, reserve):
            return cls(kv_heads, kv_heads, reserve)

        def add_keys(self, new_keys, valid=None):
            batch, heads, tokens, _ = new_keys.shape
            self.marks.claim((batch, heads), tokens, (), torch.float32, new_keys.device).fill_(1)

        def score_query(self, query):
            return query

        def prefill_scores(self, query):
            return torch.arange(self.length, dtype=torch.float32).expand(*query.shape[:3], -1)

        def decode_scores(self, query, rows=None, heads=None):
            return torch.arange(self.length, dtype=torch.float32).expand(*query.shape[:2], -1)

    assert policy_class("counting") is Counting and Counting.name == "counting" and not Counting.supports_static
    # the config knows the new policy and its options without a change to hshare.config
    config = HShareConfig(policy="counting", counting_weight=3)
    assert config.policy == CountingConfig(weight=3) and config.policy.describe() == "counting weight 3"
    assert HShareConfig.from_dict(config.to_dict()) == config
    assert resolve_config("ds", policy="counting").policy == CountingConfig()
    with pytest.raises(ConfigError, match="'counting_weight' belongs to the 'counting' policy, but the config's policy "
                                          "is 'labels'; accepted for it: label_channels, label_bits, heavy_channels"):
        HShareConfig(counting_weight=2)
    made = policy_class("counting").from_prefill(config, None, 0, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8),
                                                 torch.ones(1, 4, dtype=torch.bool), 2, 0)
    made.append(torch.zeros(1, 2, 4, 8))
    assert made.length == 4 and made.nbytes() == 2 * 4 * 4 and made.buffers == (made.marks,)
    with pytest.raises(NotImplementedError, match="'counting' selection policy has no static-shape write"):
        made.write(torch.tensor([3]), torch.zeros(1, 2, 4, 8))

    with pytest.raises(ValueError, match="'counting' is registered twice"):
        register_policy("counting")(type("Other", (Counting,), {}))
    with pytest.raises(TypeError, match="accepted: a SelectionPolicy subclass"):
        register_policy("plain")(dict)
    with pytest.raises(TypeError, match="config_class = PolicyConfig; accepted: a PolicyConfig subclass of the policy's own"):
        register_policy("bare")(type("Bare", (Counting,), {"config_class": PolicyConfig}))
    with pytest.raises(ValueError, match="unit = 'bytes'; accepted: 'tokens', 'pages'"):
        register_policy("bytes")(type("Bytes", (Counting,), {"unit": "bytes"}))
    with pytest.raises(TypeError, match="slot_buffers \\('pages',\\) but no slots"):
        type("Paged", (Counting,), {"slot_buffers": ("pages",)})
    with pytest.raises(TypeError, match="tokens_last_buffers \\('codes',\\) that are not among its column_buffers"):
        type("Misnamed", (Counting,), {"tokens_last_buffers": ("codes",)})
    assert type("Transposed", (Counting,), {"tokens_last_buffers": ("marks",)})(2, 2, 0).marks.tokens_last


def test_each_policy_describes_itself():
    config = HShareConfig()
    assert config.policy.describe() == "labels 16x4b, heavy channels auto"
    assert config.replace(policy="quest", page_size=8).policy.describe() == "quest pages of 8"
    assert config.replace(policy="loki").policy.describe() == "loki rank head_dim/4"
    assert config.replace(policy="loki", loki_rank=12).policy.describe() == "loki rank 12"
    assert [policy_class(name).config_class.name for name in POLICIES] == list(POLICIES)


# ---- storage mechanics, for every policy ----------------------------------------------------------

@pytest.mark.parametrize("name", POLICIES)
def test_lengths_buffers_and_bytes(name):
    policy, _ = filled(name)
    columns = PROMPT + DECODED
    assert policy.length == columns
    assert policy.nbytes() == expected_nbytes(name, BATCH, columns)
    assert policy.scored_units() == expected_slots(name, columns)
    column_buffers = {"labels": ("codes", "scale", "zero"), "quest": (), "loki": ("projected",)}[name]
    assert policy.buffers == tuple(getattr(policy, buffer) for buffer in column_buffers)
    assert all(buffer.length == columns and buffer.capacity == RESERVE for buffer in policy.buffers)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("selection", ["kv_head", "query_head"])
def test_select_rows_reorders_repeats_and_drops_rows(name, selection):
    """After select_rows(rows), the policy scores as the old one did at those rows; per-row tensors
    follow (Quest's page offsets, Loki's components, dynamic labels' channels)."""
    policy, _ = filled(name, selection)
    query = query_of()
    before = policy.decode_scores(query)
    rows = torch.tensor([2, 0, 0, 1])
    policy.select_rows(rows)
    assert policy.nbytes() == expected_nbytes(name, 4, PROMPT + DECODED, policy.sel_heads)
    torch.testing.assert_close(policy.decode_scores(query[rows]), before[rows], rtol=0, atol=0)
    per_row = {"labels": "channels", "quest": "shift", "loki": "components"}[name]
    assert getattr(policy, per_row).shape[0] == 4


@pytest.mark.parametrize("reserve", [0, 6])
def test_a_tokens_last_buffer_keeps_its_layout_through_growth_writes_and_row_selection(reserve):
    """`GrowingBuffer(tokens_last=True)` (Loki's projected keys): whatever happens to it (the reserve, growth
    past it, a static write, select_rows), its view holds what a default buffer given the same calls holds,
    and each entry's tokens stay adjacent in memory (stride 1 along the tokens)."""
    from hshare.buffer import GrowingBuffer

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    tokens_last, default = GrowingBuffer(reserve, tokens_last=True), GrowingBuffer(reserve)

    def same():
        assert tokens_last.view().stride(2) == 1 and tokens_last.length == default.length
        held = default.length  # a frozen view is the whole storage: compare the tokens held
        assert torch.equal(tokens_last.view()[:, :, :held], default.view()[:, :, :held])

    for step in (5, 1, 300):  # within the reserve, then growth (the stored tokens copied)
        new = torch.randn(3, 2, step, 4, generator=gen)
        tokens_last.append(new), default.append(new)
        same()
    rows = torch.tensor([2, 0, 0])
    tokens_last.select_rows(rows), default.select_rows(rows)
    same()
    tokens_last.freeze(), default.freeze()
    column, new = torch.tensor([3]), torch.randn(3, 2, 1, 4, generator=gen)
    tokens_last.write(column, new), default.write(column, new)
    same()
    assert tokens_last.nbytes() == default.nbytes()


def test_calibrated_label_channels_are_shared_by_all_rows():
    channels = torch.tensor([[[0, 2, 4, 6], [1, 3, 5, 7]]])  # [1, H_sel, r]: every row
    labels = LabelCache(channels, BITS, KV_HEADS)
    keys, _ = padded_keys()
    labels.append(keys)
    labels.select_rows(torch.tensor([1, 1, 0, 2, 2]))
    assert labels.channels is channels and labels.codes.view().shape[0] == 5


@pytest.mark.parametrize("name", POLICIES)
def test_crop_keeps_the_first_columns(name):
    policy, _ = filled(name)
    query = query_of()
    before = policy.decode_scores(query)
    policy.crop(17)
    assert policy.length == 17 and policy.nbytes() == expected_nbytes(name, BATCH, 17)
    after = policy.decode_scores(query)
    assert after.shape == before.shape[:-1] + (17,)
    if name != "quest":  # Quest ranks pages, and a page cut in the middle keeps its bounds (see hshare.quest)
        torch.testing.assert_close(after, before[..., :17], rtol=0, atol=0)
    policy.crop(40)  # beyond the length: nothing changes
    assert policy.length == 17


@pytest.mark.parametrize("name", POLICIES)
def test_freeze_exposes_the_reserve_and_thaw_returns(name):
    policy, keys = filled(name)
    columns = PROMPT + DECODED
    query = query_of()
    eager = policy.decode_scores(query)
    unit = "slots" if name == "quest" else "columns"
    needed, held = expected_slots(name, RESERVE + 8), expected_slots(name, RESERVE)
    with pytest.raises(RuntimeError, match=f"{name} reserved for {held} {unit}, static decode needs {needed}"):
        policy.freeze(RESERVE + 8)
    assert policy.frozen_width is None
    policy.freeze(RESERVE)
    assert policy.frozen_width == RESERVE and policy.length == RESERVE and policy.scored_units() == held
    frozen = policy.decode_scores(query)
    assert frozen.shape == eager.shape[:-1] + (RESERVE,)
    if name != "quest":  # token scores: the written columns score as before (Quest ranks every reserved page)
        torch.testing.assert_close(frozen[..., :columns], eager, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="frozen"):
        policy.append(keys[:, :, :1])
    policy.thaw(columns)
    assert policy.frozen_width is None and policy.length == columns
    assert policy.scored_units() == expected_slots(name, columns)
    torch.testing.assert_close(policy.decode_scores(query), eager, rtol=0, atol=0)
