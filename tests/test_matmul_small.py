"""Small-output matmul configurations (few rows, a linear layer's width) against numpy on a real device.

The candidates of :data:`hetero.kernels.matmul.SMALL_M_CANDIDATES` and the configurations
:func:`hetero.kernels.matmul.small_output_config` proposes, at MiniLM's linear-layer widths
for a few rows, with and without bias, K split and summed in a second pass.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hetero
import hetero.kernels.matmul as MM
from hetero.kernels.matmul import MatmulConfig, matmul
from hetero.kernels.matmul.config import SMALL_SPLIT_ENV, SMALL_SPLIT_MAX, SMALL_SPLIT_MIN, SMALL_SPLIT_WORKGROUPS
from hetero.kernels.matmul.op import Problem, split_parts

from tests.test_matmul import MockGPU, check, rand, reference


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty tuning cache of its own, and the small-output switch unset."""
    d = tmp_path / "cache"
    monkeypatch.setenv("HETERO_CACHE_DIR", str(d))
    monkeypatch.delenv(SMALL_SPLIT_ENV, raising=False)
    return d


MS = (1, 7, 20, 33)
NK = ((384, 384), (1536, 384), (384, 1536), (1536, 1536))  # N, K
ODD = (7, 70, 522)  # M, N, K: scalar loads of A and B, scalar stores, scalar summing pass


Case = tuple[np.ndarray, np.ndarray, "np.ndarray | None", bool, MatmulConfig]  # a, b, bias, transpose_b, config


def _run_all(dev: Any, cases: list[Case]) -> list[np.ndarray]:
    """Every case's ``matmul(config=)`` recorded into one GPU context, one submission, downloaded."""
    ctx = hetero.GPUContext(dev, "small-m-test")
    try:
        outs = []
        for a, b, bias, tb, c in cases:
            t = matmul(ctx, ctx.upload(a), ctx.upload(b), transpose_b=tb,
                       bias=None if bias is None else ctx.upload(bias), config=c)
            ctx.stage_download(t)
            outs.append(t)
        dev.wait(dev.submit([ctx.encoder.finish()]))
        got = ctx.read_downloads()
        ctx.settle(ran=True)
        return [got[id(t)] for t in outs]
    finally:
        ctx.release_blocks()


def _check_all(dev: Any, cases: list[Case]) -> None:
    for (a, b, bias, tb, c), got in zip(cases, _run_all(dev, cases)):
        check(got, reference(a, b, tb, bias),
              what=f"{c.name} {a.shape} @ {b.shape} transpose_b={tb} bias={bias is not None}")


@pytest.mark.parametrize("j_config", list(enumerate(MM.SMALL_M_CANDIDATES)), ids=lambda jc: jc[1].name)
def test_small_m_candidates_match_numpy(shared_rt: hetero.Runtime, j_config: tuple[int, MatmulConfig]) -> None:
    """M = 1, 7, 20, 33, each with one of N, K in 384, 1536 (rotating over the candidates) as
    nn.Linear stores its weight (transpose_b), bias on every other one; a plain B and odd sizes too."""
    j, c = j_config
    dev = shared_rt.device()
    assert c.fits(dev.limits) is None
    cases: list[Case] = []
    for i, m in enumerate(MS):
        n, k = NK[(i + j) % len(NK)]
        bias = rand((n,), 300 + i) if (i + j) % 2 == 0 else None
        cases.append((rand((m, k), i), rand((n, k), 100 + i), bias, True, c))
    cases.append((rand((20, 1536), 1), rand((1536, 384), 2), rand((384,), 3), False, c))  # plain B
    m, n, k = ODD
    cases.append((rand((m, k), 4), rand((n, k), 5), rand((n,), 6), True, c))
    cases.append((rand((m, k), 7), rand((k, n), 8), None, False, c))
    _check_all(dev, cases)


def test_small_output_rule_matches_numpy(shared_rt: hetero.Runtime) -> None:
    """What the rule picks for every M = 1, 7, 20, 33 times N, K in 384, 1536 (transpose_b, with
    and without bias), and for the odd shape."""
    dev = shared_rt.device()
    cases: list[Case] = []
    for i, (m, (n, k)) in enumerate(itertools.product(MS, NK)):
        c = MM.default_config("DiscreteGPU", m, n, k=k, small_split=True, limits=dev.limits)
        assert c == MM.small_output_config(m, n, k) and c.split_k > 1, (m, n, k, c)
        assert split_parts(Problem(m, n, k, 1, 0, 0, (m, n), False, True, False), c, 1 << 27)[0] > 1  # two passes
        bias = rand((n,), 300 + i) if i % 2 == 0 else None
        cases.append((rand((m, k), i), rand((n, k), 100 + i), bias, True, c))
    m, n, k = ODD
    c = MM.small_output_config(m, n, k)
    assert c is not None and c.split_k > 1
    cases.append((rand((m, k), 4), rand((n, k), 5), rand((n,), 6), True, c))
    _check_all(dev, cases)


def test_small_split_parts_and_workgroups() -> None:
    """The split candidates really split MiniLM's K = 384 and 1536 (the default parts of 256 would not)."""
    def parts(c: MatmulConfig, m: int, n: int, k: int) -> tuple[int, int]:
        p = Problem(m, n, k, 1, 0, 0, (m, n), False, True, False)
        return split_parts(p, c, 1 << 27)

    c = MatmulConfig(32, 32, 8, 4, 4, split_k=16, split_min=SMALL_SPLIT_MIN)
    assert parts(c, 20, 384, 384) == (6, 64)
    assert parts(c, 20, 384, 1536) == (16, 96)
    assert parts(c, 20, 384, 100) == (1, 100)  # too short to split
    assert parts(MatmulConfig(32, 32, 8, 4, 4, split_k=16), 20, 384, 384) == (1, 384)  # parts of 256: no split
    assert parts(MatmulConfig(32, 32, 8, 4, 4, split_k=16), 20, 384, 1536) == (6, 256)
    # every part is non-empty and they cover K
    for k in (64, 130, 384, 522, 1536):
        s, kc = parts(MatmulConfig(16, 64, 8, 4, 4, split_k=16, split_min=SMALL_SPLIT_MIN), 7, 70, k)
        assert kc % 8 == 0 or s == 1
        assert (s - 1) * kc < k <= s * kc


def test_small_output_rule_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    gpu, small = "DiscreteGPU", MatmulConfig(32, 32, 8, 4, 4)
    assert MM.default_config(gpu, 20, 384) == small
    assert MM.default_config(gpu, 20, 384, k=384) == small  # opt-in
    proposed = MM.default_config(gpu, 20, 384, k=384, small_split=True)
    assert proposed == MatmulConfig(32, 32, 8, 4, 4, split_k=6, split_min=SMALL_SPLIT_MIN)
    assert proposed.name == "32x32x8/4x4/db/sk6/p64"
    monkeypatch.setenv(SMALL_SPLIT_ENV, "1")
    assert MM.default_config(gpu, 20, 384, k=384) == proposed
    assert MM.default_config(gpu, 20, 384, k=384, small_split=False) == small
    # CPU adapters keep their measured defaults; without K (matmul_int8) nothing changes
    assert MM.default_config("CPU", 20, 384, k=384) == MM.default_config("CPU", 20, 384)
    assert MM.default_config(gpu, 20, 384) == small
    # large outputs are untouched
    assert MM.default_config(gpu, 4096, 4096, k=4096) == MatmulConfig(128, 128, 8, 8, 8)
    assert MM.default_config(gpu, 512, 1536, k=384) == MM.default_config(gpu, 512, 1536)
    # matmul(..., small_split=) reaches the rule through choose_config (no tuned entry here)
    monkeypatch.delenv(SMALL_SPLIT_ENV)
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))

    class FakeDevice:
        adapter_info = {"device": "a large GPU", "adapter_type": gpu, "backend_type": "Vulkan"}

    class FakeContext:
        device = FakeDevice()
        limits: dict[str, int] = {}

    ctx = FakeContext()
    assert MM.choose_config(ctx, 20, 384, 384) == small
    assert MM.choose_config(ctx, 20, 384, 384, small_split=True) == proposed
    assert MM.explain_config(ctx, 20, 384, 384, small_split=True) == (proposed, "default")


def test_small_output_rule_shapes() -> None:
    rule = MM.small_output_config
    assert rule(1, 1152, 384) == MatmulConfig(16, 64, 8, 4, 4, split_k=6, split_min=SMALL_SPLIT_MIN)  # 18 tiles
    assert rule(16, 384, 1536) == MatmulConfig(16, 64, 8, 4, 4, split_k=16, split_min=SMALL_SPLIT_MIN)
    assert rule(20, 1536, 1536) == MatmulConfig(32, 32, 8, 4, 4, split_k=6, split_min=SMALL_SPLIT_MIN)
    assert rule(128, 1536, 384) == MatmulConfig(32, 32, 8, 4, 4, split_k=2, split_min=SMALL_SPLIT_MIN)
    assert rule(20, 384, 100) is None and rule(4, 384, 100) is None  # K too short to split
    assert MM.default_config("DiscreteGPU", 4, 20, k=32, small_split=True) == MatmulConfig(32, 32, 8, 4, 4)
    assert rule(512, 512, 384) is None  # 256 tiles: enough workgroups already
    assert rule(20, 384, 384, limits={"max-compute-workgroup-storage-size": 1024}) is None
    for m, (n, k) in itertools.product((1, 8, 20, 32, 64, 128), NK):
        c = rule(m, n, k)
        assert c is not None and 2 <= c.split_k <= SMALL_SPLIT_MAX
        tiles = -(-m // c.bm) * -(-n // c.bn)
        assert tiles * (c.split_k - 1) < SMALL_SPLIT_WORKGROUPS


def test_split_min_in_names_dicts_and_validation() -> None:
    c = MatmulConfig(16, 64, 8, 4, 4, split_k=8, split_min=64)
    assert c.name == "16x64x8/4x4/db/sk8/p64" and c.threads == 64
    assert c.to_dict()["split_min"] == 64 and MatmulConfig.from_dict(c.to_dict()) == c
    plain = MatmulConfig(128, 128, 8, 8, 8, split_k=2)
    assert "split_min" not in plain.to_dict() and plain.name == "128x128x8/8x8/db/sk2"  # caches as before
    assert MatmulConfig.from_dict(plain.to_dict()) == plain
    with pytest.raises(ValueError, match=r"split_min must be a positive multiple of 4, got 6"):
        MatmulConfig(32, 32, 8, 4, 4, split_k=2, split_min=6)
    with pytest.raises(ValueError, match=r"split_min must be a positive multiple of 4, got 0"):
        MatmulConfig.from_dict({"bm": 32, "bn": 32, "bk": 8, "tm": 4, "tn": 4, "split_min": 0})


def test_choose_config_passes_k_to_the_rule(shared_rt: hetero.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """On lavapipe (a CPU adapter) the switch changes nothing; the rule sees K through choose_config."""
    dev = shared_rt.device()
    gpu = MockGPU(dev)
    before = MM.choose_config(gpu, 20, 384, 384)
    monkeypatch.setenv(SMALL_SPLIT_ENV, "1")
    if dev.summary["type"].upper() == "CPU":
        assert MM.choose_config(gpu, 20, 384, 384) == before
    else:
        assert MM.choose_config(gpu, 20, 384, 384) == MM.small_output_config(20, 384, 384, limits=dev.limits)


def test_tune_over_small_candidates(shared_rt: hetero.Runtime) -> None:
    """The tuner checks and times split candidates with short parts (as the small-M bench uses it)."""
    dev = shared_rt.device()
    configs = (MM.SMALL_M_CANDIDATES[0], MatmulConfig(16, 64, 8, 4, 4, split_k=4, split_min=SMALL_SPLIT_MIN))
    r = MM.tune(dev, 20, 384, 384, transpose_b=True, configs=configs, min_ms=1, repeat=1, save=False)
    assert r.best in configs and [name for name, _, _ in r.results] == [c.name for c in configs]
    assert all(g is not None and g > 0 for _, g, _ in r.results), r.results
