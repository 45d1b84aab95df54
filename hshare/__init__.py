"""hshare: faster decoding for HuggingFace transformers.

``hshare.patch(model)`` makes a Llama or Mistral model decode with HShare hierarchical sparse
attention (critical tokens chosen on a label cache, shared across layers, heads and adjacent
steps). See README.md.
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
