"""Shims over transformers releases that the model packages share (pyproject allows >=5.17,<6).

transformers 5.24 renamed the decoder's KV-cache argument and output from
``past_key_values`` to ``cache``; the old argument still works there with a FutureWarning
and goes away in 5.40. Callers pass the cache under whichever name the model takes.
"""

from __future__ import annotations

import inspect
from functools import lru_cache


@lru_cache(maxsize=None)
def cache_kwarg(model_cls: type) -> str:
    """Name of the KV-cache argument of ``model_cls.forward`` (``cache`` or ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def output_cache(out):
    """The KV cache of a model output (``cache`` from 5.24, ``past_key_values`` before)."""
    cache = out.get("cache") if "cache" in out else None
    return cache if cache is not None else out.past_key_values
