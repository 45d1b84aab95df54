"""hshare: faster decoding for HuggingFace transformers.

``hshare.patch(model)`` makes a supported causal LM (`hshare.patches`) decode with HShare
hierarchical sparse attention (critical tokens chosen cheaply by a selection policy, shared across
layers, heads and adjacent steps) and hold a prompt prefix shared by the rows once (Hydragen).
See README.md.
"""

from hshare.api import new_cache, patch, patched, unpatch, unpatched
from hshare.cache import HShareCache
from hshare.counters import DecodeStats
from hshare.config import (BudgetConfig, ConfigError, HShareConfig, PlannerConfig, PrefixConfig, RuntimeConfig,
                           SharingConfig, preset_names, resolve_config)
from hshare.patches import UnsupportedModelError

__version__ = "0.1.0"

__all__ = [
    "BudgetConfig",
    "ConfigError",
    "DecodeStats",
    "HShareCache",
    "HShareConfig",
    "PlannerConfig",
    "PrefixConfig",
    "RuntimeConfig",
    "SharingConfig",
    "UnsupportedModelError",
    "new_cache",
    "patch",
    "patched",
    "preset_names",
    "resolve_config",
    "unpatch",
    "unpatched",
]
