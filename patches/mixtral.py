"""Mixtral: Mistral's attention (GQA, an optional sliding window in every layer) with a mixture of
experts in place of the MLP.

The experts and their router sit after attention and never touch the cache, so hshare's attention
function sees exactly Mistral's queries, keys and masks; the window is handled as Mistral's (the
sliding-window mask is read as key validity, full KV is kept). Routing is per token, so a decode
step's output depends on attention only through the hidden state, as in a dense model.
"""

from .base import ArchitectureAdapter

MIXTRAL = ArchitectureAdapter(model_type="mixtral", attention_class="MixtralAttention")
