"""Every difference between the transformers releases hshare supports, in one place.

The rest of hshare reads and writes the cache, the model outputs and the cache layers only through
this module, so a new transformers release that renames or reshapes one of them is one edit here,
commented with the release that changed it. The tested range is `OLDEST_TESTED` to `NEWEST_TESTED`
(minor releases, both ends run by CI: ``.ci/run``); ``make compat`` runs the suite on the newest
release on the registry, ignoring the range's upper bound.
"""

from __future__ import annotations

import warnings
from typing import Any

import transformers
from packaging.version import Version

# The tested range, as minor releases. pyproject's dependency is ``>=OLDEST_TESTED,<next minor after
# NEWEST_TESTED``: raise both together, in the commit whose CI run proves the new release.
OLDEST_TESTED = "5.17"
NEWEST_TESTED = "5.25"

INSTALLED = Version(transformers.__version__)


def _since(release: str) -> bool:
    """Whether the installed transformers is `release` or later (pre-releases of it included)."""
    return INSTALLED.release >= Version(release).release


# Differences that need no code here (tests allow for them):
# - 5.23: SDPA decode folds a GQA query onto its KV head (``pack_gqa``) as hshare does; before, it repeats
#   K/V per query head, so unpatched and patched logits agree to rounding, not bit for bit.
# - 5.25: transformers requires HF's ``kernels`` package and imports it at import time; hshare's kernels live in
#   ``hshare/kernels`` so that no top-level ``kernels`` folder of a checkout (on sys.path when run from its root)
#   hides it.

# 5.24 renamed the cache argument of forward/generate and the outputs' field from past_key_values to cache.
CACHE_KWARG = "cache" if _since("5.24") else "past_key_values"
CACHE_SPELLINGS = ("cache", "past_key_values")


def check_installed() -> None:
    """Refuse a transformers older than the tested range; warn about a newer one (``hshare.patch`` calls it).

    Raises:
        RuntimeError: naming the installed release and the tested range.
    """
    oldest, newest = Version(OLDEST_TESTED), Version(NEWEST_TESTED)
    minor = Version(f"{INSTALLED.major}.{INSTALLED.minor}")
    tested = f"transformers {OLDEST_TESTED}.x to {NEWEST_TESTED}.x"
    if minor < oldest:
        raise RuntimeError(
            f"hshare does not support transformers {INSTALLED} (installed); accepted: {tested} "
            f"(pip install 'transformers>={OLDEST_TESTED},<{_next_minor(newest)}')"
        )
    if minor > newest:
        warnings.warn(
            f"transformers {INSTALLED} is newer than hshare was tested on ({tested}); patched models may "
            f"fail or differ from unpatched ones. `make compat` runs hshare's tests against it.",
            RuntimeWarning, stacklevel=3,
        )


def _next_minor(version: Version) -> str:
    return f"{version.major}.{version.minor + 1}"


# ---- the cache argument: both spellings accepted, the installed release's one passed on -------------
def cache_from(kwargs: dict) -> Any:
    """The cache in a call's keyword arguments, under either spelling (``cache=`` or ``past_key_values=``).

    Raises:
        ValueError: when both spellings carry a cache.
    """
    given = [name for name in CACHE_SPELLINGS if kwargs.get(name) is not None]
    if len(given) > 1:
        raise ValueError("both cache= and past_key_values= were given; accepted: one of them (they name the "
                         "same argument)")
    return kwargs[given[0]] if given else None


def with_cache(kwargs: dict, cache: Any) -> dict:
    """`kwargs` with `cache` under the installed release's name and the other spelling removed (in place)."""
    for name in CACHE_SPELLINGS:
        kwargs.pop(name, None)
    kwargs[CACHE_KWARG] = cache
    return kwargs


def without_cache(kwargs: dict) -> dict:
    """`kwargs` without either spelling of the cache argument (a new dict)."""
    return {name: value for name, value in kwargs.items() if name not in CACHE_SPELLINGS}


def output_cache(output: Any) -> Any:
    """The cache a model output or a ``generate`` output returns (None where it holds none)."""
    if output is None or not hasattr(output, "keys"):
        return None
    return output.get(CACHE_KWARG)


def causal_lm_output(logits, cache) -> Any:
    """transformers' ``CausalLMOutputWithPast`` holding `logits` and `cache` under the installed release's name."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits, **{CACHE_KWARG: cache})
