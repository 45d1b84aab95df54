"""Mistral: Llama's attention plus an optional sliding window.

The window is enforced by transformers' sliding-window mask, which hshare's attention function
reads as key validity: the sparse path never selects a token outside the window, and the sink is
the first token inside it. hshare's cache keeps full KV (it does not clip to the window).
"""

from .base import ArchitectureAdapter

MISTRAL = ArchitectureAdapter(model_type="mistral", attention_class="MistralAttention")
