"""Ready-made graphs, shipped as ``hetero.pipelines``.

``hetero.pipelines.Encoder`` (sentence embeddings, used like sentence-transformers'
``SentenceTransformer``) is imported on first use, so ``import hetero`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Encoder"]


def __getattr__(name: str) -> Any:
    if name == "Encoder":
        from .encoder import Encoder

        return Encoder
    raise AttributeError(f"module 'hetero.pipelines' has no attribute {name!r}")
