"""Ready-made graphs, shipped as ``hetero.pipelines``.

``hetero.pipelines.Encoder`` (sentence embeddings, used like sentence-transformers'
``SentenceTransformer``) and ``hetero.pipelines.LLM`` (text generation with Llama-family
decoders; its results are ``Completion`` and ``StreamPiece``, its ``stats()`` a
``GenerationStats``) are imported on first use, so
``import hetero`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "Completion", "Encoder", "GenerationStats", "StreamPiece"]


def __getattr__(name: str) -> Any:
    if name == "Encoder":
        from .encoder import Encoder

        return Encoder
    if name in ("LLM", "Completion", "GenerationStats", "StreamPiece"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'hetero.pipelines' has no attribute {name!r}")
