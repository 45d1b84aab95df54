"""hshare: faster decoding for HuggingFace transformers.

``hshare.patch(model)`` makes a supported causal LM (`hshare.patches`) decode with HShare
hierarchical sparse attention (critical tokens chosen cheaply by a selection policy, shared across
layers, heads and adjacent steps) and hold a prompt prefix shared by the rows once (Hydragen).
See README.md.
"""

from hshare.api import new_cache, patch, patched, unpatch
from hshare.cache import HShareCache
from hshare.counters import DecodeStats
from hshare.config import ConfigError, HShareConfig, preset_names
from hshare.patches import UnsupportedModelError

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DecodeStats",
    "HShareCache",
    "HShareConfig",
    "UnsupportedModelError",
    "new_cache",
    "patch",
    "patched",
    "preset_names",
    "unpatch",
]
