"""``hetero.kernels`` re-exports the decoder's ops and weight formats: ``__all__`` matches them, both ways."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_kernels_reexport_the_decoder_ops_and_weight_formats() -> None:
    import hetero.kernels as K
    import hetero.kernels.decoder as D
    import hetero.kernels.quant as Q

    assert sorted(K.__all__) == K.__all__
    assert set(K.__all__) == set(D.__all__) | set(Q.__all__)
    assert not set(D.__all__) & set(Q.__all__)
    for name in D.__all__:
        assert getattr(K, name) is getattr(D, name)
    for name in Q.__all__:
        assert getattr(K, name) is getattr(Q, name)
    assert all(callable(getattr(K, n)) for n in K.__all__ if n not in ("BLOCK", "BLOCK_BYTES", "KINDS"))
    assert set(K.__all__) <= set(dir(K))
    from hetero.kernels import linear, pack, paged_attention

    assert (linear, pack, paged_attention) == (D.linear, Q.pack, D.paged_attention)


def test_unknown_names_are_refused() -> None:
    import hetero.kernels as K

    with pytest.raises(AttributeError, match="module 'hetero.kernels' has no attribute 'gemv'"):
        K.gemv  # noqa: B018


def test_one_kernel_module_does_not_load_the_decoder() -> None:
    code = ("import sys, hetero.kernels.reduce, hetero.kernels as K; "
            "assert 'hetero.kernels.decoder' not in sys.modules; K.rope; "
            "assert 'hetero.kernels.decoder' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
