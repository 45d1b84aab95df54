"""OLMo 2: an RMSNorm over the whole q and k projections (all heads together), applied before the
heads are split and before RoPE, so cached keys are normed and rotated: nothing to add."""

from .base import ArchitectureAdapter

OLMO2 = ArchitectureAdapter(model_type="olmo2", attention_class="Olmo2Attention")
