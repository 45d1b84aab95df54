"""Long runs: thousands of decode steps on a tiny model, with sparse steps at every step.

* Memory stays flat beyond the KV growth itself: the cache's accounting equals an independent
  formula for K/V and labels; the tensors the cache holds (found by walking it) stay within the
  growable buffers' headroom of that; tensors held anywhere else in the process do not grow with
  the steps beyond transformers' own ``input_ids`` / ``attention_mask``; the process RSS grows by
  no more than the K/V does plus allocator slack.
* Host work per step does not grow with the steps. On CPU there is no CUDA sync to count, so the
  test counts what would be one: every host read of a tensor's value (``item``, ``tolist``,
  ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``cpu``, ``numpy``) made from hshare's
  own code during each decode step, and, over a window of steps early and late in the run, the
  Python function calls executed in hshare's code per step. Both must be the same per step
  (periodic with the query group) after thousands of steps as at the start.

Marked slow (``pytest -m slow``): about a minute on 2 CPU cores.
"""

from __future__ import annotations

import gc
import os
import sys
from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

import hshare

from conftest import cache_kwarg, left_padded

pytestmark = pytest.mark.slow

STEPS = 3000  # new tokens: STEPS - 1 decode steps
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 2, 1, 16
BUDGET = dict(sink=2, local=8, heavy=6)  # N_c = 16: every step is sparse
LABEL_CHANNELS, LABEL_BITS = 16, 4
LENGTHS = [40, 25]
CHECKPOINTS = (250, 500, 1000, 1500, 2000, 2500, STEPS)  # calls of the stopping criterion (1 = prefill)
PROFILED = ((101, 111), (STEPS - 20, STEPS - 10))  # windows of decode steps whose Python calls are counted
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
HSHARE_DIRS = (os.path.dirname(os.path.abspath(hshare.__file__)) + os.sep,)
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=STEPS + 128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def expected_kv_and_label_bytes(batch: int, columns: int) -> int:
    """K and V (fp32) of every layer plus the label cache of every sparse layer: 4-bit codes of 16
    channels and an fp32 scale and zero per (row, KV head, token)."""
    kv = LAYERS * 2 * batch * KV_HEADS * columns * HEAD_DIM * 4
    labels = LAYERS * batch * KV_HEADS * columns * (LABEL_CHANNELS * LABEL_BITS // 8 + 2 * 4)
    return kv + labels


def storages(tensors) -> dict[int, int]:
    """Distinct storages (data pointer -> bytes) of some tensors."""
    out = {}
    for t in tensors:
        storage = t.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def tensors_held_by(root) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through attributes, dataclass fields, lists, tuples, sets
    and dicts (modules and configs excluded)."""
    found, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("hshare", "transformers"):
            if type(obj).__name__.endswith("Config"):
                continue
            stack.extend(vars(obj).values())
    return found


def all_tensors() -> list[torch.Tensor]:
    """Every live tensor with real storage (torch.compile's fake tensors, kept by its caches after an
    earlier test compiled something, hold none)."""
    gc.collect()
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor) and not isinstance(obj, FakeTensor)]


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostReadCounter:
    """Counts host reads of tensor values, split by whether hshare's code made them (the first
    calling frame outside torch is in hshare / hshare.kernels) or another (transformers' loop)."""

    def __init__(self) -> None:
        self.hshare = 0
        self.total = 0
        self.sites: Counter = Counter()
        self._saved = {}

    def __enter__(self):
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(original))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, original):
        counter = self

        def read(tensor, *args, **kwargs):
            counter.total += 1
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(HSHARE_DIRS):
                counter.hshare += 1
                counter.sites[(os.path.basename(frame.f_code.co_filename), frame.f_lineno, original.__name__)] += 1
            return original(tensor, *args, **kwargs)

        return read


class Monitor(StoppingCriteria):
    """Called once per generated token (call 1 = the prefill's token): per-step counts, and memory
    at the checkpoints. Never stops generation."""

    def __init__(self, cache, reads: HostReadCounter, params: set[int]) -> None:
        self.cache, self.reads, self.params = cache, reads, params
        self.calls = 0
        self.reads_per_step: dict[int, tuple[int, int]] = {}
        self.python_calls: dict[int, int] = {}
        self.memory: dict[int, dict] = {}
        self._last = (0, 0)
        self._profile_count = 0

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(HSHARE_DIRS):
            self._profile_count += 1

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        step = self.calls - 1  # the decode step that just ran (0 = prefill)
        now = (self.reads.hshare, self.reads.total)
        self.reads_per_step[step] = (now[0] - self._last[0], now[1] - self._last[1])
        for start, end in PROFILED:
            if step == start - 1:
                sys.setprofile(self._profile)
            if start <= step < end:
                self.python_calls[step] = self._profile_count
                self._profile_count = 0
            if step == end - 1:
                sys.setprofile(None)
        if self.calls in CHECKPOINTS:
            with _paused(self.reads):
                self.memory[self.calls] = self._measure(input_ids.shape[0])
        self._last = (self.reads.hshare, self.reads.total)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def _measure(self, batch: int) -> dict:
        held = storages(tensors_held_by(self.cache))
        everything = storages(all_tensors())
        elsewhere = sum(b for ptr, b in everything.items() if ptr not in held and ptr not in self.params)
        return dict(
            objects=len(gc.get_objects()),
            columns=self.cache.get_seq_length(),
            accounted=self.cache.kv_bytes() + self.cache.label_bytes(),
            held=sum(held.values()),
            elsewhere=elsewhere,
            rss=rss_bytes(),
        )


class _paused:
    """Measuring reads tensors too: keep those reads out of the step counts."""

    def __init__(self, reads: HostReadCounter) -> None:
        self.reads = reads

    def __enter__(self):
        self.saved = (self.reads.hshare, self.reads.total)

    def __exit__(self, *exc):
        self.reads.hshare, self.reads.total = self.saved


@pytest.fixture(scope="module")
def long_run():
    model = tiny_model()
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(0))
    hshare.patch(model, "hshare-1_2-1_2-1_2", label_channels=LABEL_CHANNELS, label_bits=LABEL_BITS, **BUDGET)
    try:
        cache = hshare.new_cache(model)
        params = set(storages(list(model.parameters()) + list(model.buffers())))
        with HostReadCounter() as reads:
            monitor = Monitor(cache, reads, params)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS,
                                     do_sample=False, pad_token_id=0, **cache_kwarg(cache),
                                     stopping_criteria=StoppingCriteriaList([monitor]))
    finally:
        sys.setprofile(None)
        hshare.unpatch(model)
    return dict(out=out, cache=cache, monitor=monitor, width=ids.shape[1], batch=len(LENGTHS))


def test_every_step_is_sparse(long_run):
    stats = long_run["cache"].stats
    assert long_run["out"].shape[1] == long_run["width"] + STEPS
    assert stats.decode_steps == stats.sparse_steps == STEPS - 1
    assert stats.selection_steps == STEPS // 2  # query group of 2: steps 1, 3, 5, ...


def test_memory_stays_flat_beyond_the_kv_growth(long_run):
    memory, batch, width = long_run["monitor"].memory, long_run["batch"], long_run["width"]
    assert sorted(memory) == sorted(CHECKPOINTS)
    first, last = memory[CHECKPOINTS[0]], memory[CHECKPOINTS[-1]]
    per_token = expected_kv_and_label_bytes(batch, 1)
    final = expected_kv_and_label_bytes(batch, last["columns"])
    slack = 256 * per_token + 64 * batch * last["columns"] + 64 * 1024  # a buffer granule, O(n) step state
    for calls, m in memory.items():
        assert m["columns"] == width + calls - 1
        expected = expected_kv_and_label_bytes(batch, m["columns"])
        assert m["accounted"] == expected, f"at call {calls}: accounted {m['accounted']} != {expected}"
        assert m["held"] <= 1.3 * final + slack, f"at call {calls}: the cache holds {m['held']} bytes"
    kv_growth = final - expected_kv_and_label_bytes(batch, first["columns"])
    assert last["held"] - first["held"] <= 1.3 * kv_growth + slack, "cache tensors grow faster than the KV"
    # outside the cache: transformers' input_ids / attention_mask grow by 16 bytes per row and token
    growth_elsewhere = last["elsewhere"] - first["elsewhere"]
    assert growth_elsewhere <= 64 * batch * (last["columns"] - first["columns"]) + 256 * 1024, \
        f"tensors outside the cache grew by {growth_elsewhere} bytes"
    # Python objects: nothing accumulates per step (a list appended to per step would show here)
    assert last["objects"] - first["objects"] <= 2000, f"{last['objects'] - first['objects']} more Python objects"
    if first["rss"] is not None:
        assert last["rss"] - first["rss"] <= 2 * kv_growth + 16 * 2**20, \
            f"RSS grew by {(last['rss'] - first['rss']) / 2**20:.1f} MiB"


def test_host_reads_per_step_do_not_grow(long_run):
    reads = long_run["monitor"].reads_per_step
    steps = range(10, STEPS)  # after the first selections and the plan
    hshare_reads = [reads[s][0] for s in steps]
    total_reads = [reads[s][1] for s in steps]
    early, late = slice(0, 500), slice(-500, None)
    # the same per-step pattern (periodic with the query group of 2) early and late
    assert Counter(hshare_reads[early]) == Counter(hshare_reads[late]), (Counter(hshare_reads[early]),
                                                                          Counter(hshare_reads[late]))
    assert Counter(total_reads[early]) == Counter(total_reads[late])
    # measured: 1 per step (RowWindows.all_short, the step's documented host read); the plan step reads more
    assert max(hshare_reads) <= 2, (f"hshare reads tensor values {max(hshare_reads)} times in one decode step: "
                                    f"{long_run['monitor'].reads.sites.most_common(5)}")


def test_python_work_per_step_does_not_grow(long_run):
    calls = long_run["monitor"].python_calls
    (a0, a1), (b0, b1) = PROFILED
    early = [calls[s] for s in range(a0, a1)]
    late = [calls[s] for s in range(b0, b1)]
    assert min(early) > 0, "the profiler saw no hshare code"
    assert sorted(early) == sorted(late), (early, late)
