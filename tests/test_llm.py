"""Text generation (hetero.pipelines.LLM) against the numpy reference decoder, on tiny random models and SmolLM2."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import anyio
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from llm_fixtures import write_tiny_gguf, write_tiny_hf_dir  # noqa: E402

import hetero  # noqa: E402
from hetero.errors import InputError, RuntimeClosedError  # noqa: E402
from hetero.pipelines import LLM, Completion, StreamPiece  # noqa: E402
from hetero.pipelines.kv_cache import KVCacheFullError  # noqa: E402
from hetero.pipelines.llm_engine import bucket  # noqa: E402
from hetero.pipelines.llm_model import load_model  # noqa: E402
from hetero.pipelines.llm_reference import reference_greedy, reference_logits  # noqa: E402

KV = 1 << 20  # 1 MiB of KV cache: 128 blocks of 16 tokens for the tiny models
PROMPTS = ["The quick brown fox", "What is the capital of France?", "def f(x):\n    return", "A"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    return {
        "llama": write_tiny_gguf(d / "llama.gguf", "llama", "f32"),
        "qwen2": write_tiny_gguf(d / "qwen2.gguf", "qwen2", "f32"),
        "tied": write_tiny_gguf(d / "tied.gguf", "llama", "f32", tied=True),
        "q8_0": write_tiny_gguf(d / "q8.gguf", "llama", "q8_0"),
        "q4_1": write_tiny_gguf(d / "q41.gguf", "qwen2", "q4_1"),
        "q4_0": write_tiny_gguf(d / "q40.gguf", "llama", "q4_0"),
        "hf-qwen2": write_tiny_hf_dir(d / "qwen2-hf", "qwen2"),
    }


@pytest.fixture(scope="module")
def llama(files, shared_rt):
    with LLM(files["llama"], runtime=shared_rt, kv_cache_bytes=KV) as llm:
        yield llm


def idle(llm: LLM) -> bool:
    """Nothing reserved, and only the scratch block held."""
    return llm.engine.reserved_blocks == 0 and llm.engine.pool.num_used == 1 and len(llm.engine.pool) == 1


def close_logits(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    scale = np.abs(want).max(-1, keepdims=True)
    err = np.abs(got - want) / scale
    assert err.max() <= rtol, f"logits differ by {err.max():.2e} of each row's largest value"


def test_bucket_rounds_up_two_per_octave():
    assert [bucket(n) for n in (1, 2, 3, 5, 17, 32, 33, 48, 49, 64, 65, 100, 129)] == \
        [1, 2, 4, 8, 32, 32, 48, 48, 64, 64, 96, 128, 192]
    assert all(bucket(n) >= n for n in range(1, 3000))


@pytest.mark.parametrize("name", ["llama", "qwen2", "tied", "hf-qwen2"])
def test_logits_match_the_reference(files, shared_rt, name):
    with LLM(files[name], runtime=shared_rt, kv_cache_bytes=KV) as llm:
        ids = llm.encode(PROMPTS[1]) + llm.encode(PROMPTS[2])
        got = llm.logits(ids)
        assert got.shape == (len(ids), llm.config.vocab_size) and got.dtype == np.float32
        close_logits(got, reference_logits(llm.model, ids), 1e-5)
        assert idle(llm)


@pytest.mark.parametrize("name", ["q8_0", "q4_1", "q4_0"])
def test_quantized_weights_stay_packed_and_match_the_dequantized_reference(files, shared_rt, name):
    with LLM(files[name], runtime=shared_rt, kv_cache_bytes=KV) as llm:
        assert llm.engine.packed.layers[0].qkv.kind == name
        ids = llm.encode(PROMPTS[0])
        close_logits(llm.logits(ids), reference_logits(llm.model, ids), 1e-5)
        c = llm.generate(ids, max_tokens=12)
        assert c.token_ids == reference_greedy(llm.model, ids, 12)[:len(c.token_ids)]


def test_forced_q8_0_and_f16_weights(files, shared_rt):
    for mode in ("q8_0", "f16"):
        with LLM(files["llama"], runtime=shared_rt, weights=mode, kv_cache_bytes=KV) as llm:
            assert llm.engine.packed.layers[0].down.kind == mode
            ids = llm.encode(PROMPTS[3])
            close_logits(llm.logits(ids), reference_logits(llm.model, ids), 1e-5)


def test_greedy_generation_equals_the_reference(llama):
    ids = llama.encode(PROMPTS[1])
    c = llama.generate(PROMPTS[1], max_tokens=20)
    assert isinstance(c, Completion)
    want = reference_greedy(llama.model, ids, 20, stop_at_eos=True)
    eos = set(llama.config.eos_token_ids)
    if want[-1] in eos:
        assert c.finish_reason == "stop" and c.token_ids == want[:-1]
    else:
        assert c.finish_reason == "length" and c.token_ids == want
    assert c.text == llama.decode(c.token_ids)
    assert c.prompt_tokens == len(ids) and c.completion_tokens == len(c.token_ids)
    assert c.ttft_s is not None and c.ttft_s > 0 and c.gpu_s is None
    assert idle(llama)


def test_decode_steps_replay_their_capture(llama):
    llama.generate(PROMPTS[0], max_tokens=4)
    llama.generate(PROMPTS[0], max_tokens=4)
    assert llama.runtime.stats().stage("forward").replayed


def test_a_batch_decodes_together_and_equals_each_prompt_alone(llama):
    alone = [llama.generate(p, max_tokens=10) for p in PROMPTS]
    together = llama.generate(PROMPTS, max_tokens=10)
    assert isinstance(together, list) and len(together) == len(PROMPTS)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.text for c in together] == [c.text for c in alone]
    assert idle(llama)


def test_prompts_wait_for_room_in_a_small_cache(files, shared_rt):
    """Six prompts, room for two at a time: all finish, each as it would alone, nothing left held."""
    with LLM(files["llama"], runtime=shared_rt, kv_cache_bytes=8 * 1024 * 5, max_seq_len=64) as llm:
        assert llm.engine.num_blocks == 4
        prompts = [PROMPTS[i % 4] for i in range(6)]
        alone = [llm.generate(p, max_tokens=12).token_ids for p in prompts]
        together = llm.generate(prompts, max_tokens=12)
        assert [c.token_ids for c in together] == alone
        assert idle(llm)


def test_long_prompts_are_chunked(files, shared_rt):
    with LLM(files["qwen2"], runtime=shared_rt, kv_cache_bytes=KV, max_batch_tokens=5) as llm:
        ids = llm.encode(" ".join(PROMPTS))
        assert len(ids) > 10
        c = llm.generate(ids, max_tokens=6)
        assert c.token_ids == reference_greedy(llm.model, ids, 6)[:len(c.token_ids)]
        close_logits(llm.logits(ids), reference_logits(llm.model, ids), 1e-5)


def test_sampling_is_reproducible_by_seed(llama):
    a = llama.generate(PROMPTS[0], max_tokens=16, temperature=1.0, seed=7)
    b = llama.generate(PROMPTS[0], max_tokens=16, temperature=1.0, seed=7)
    assert a.token_ids == b.token_ids
    others = {tuple(llama.generate(PROMPTS[0], max_tokens=16, temperature=1.5, seed=s).token_ids)
              for s in range(4)}
    assert len(others) > 1
    # top_k=1 leaves one token: greedy
    greedy = llama.generate(PROMPTS[0], max_tokens=16)
    assert llama.generate(PROMPTS[0], max_tokens=16, temperature=0.9, top_k=1, seed=3).token_ids == greedy.token_ids
    # in a batch, prompt i samples with seed + i, as it would alone
    batch = llama.generate([PROMPTS[0], PROMPTS[2]], max_tokens=8, temperature=1.0, seed=11)
    assert batch[1].token_ids == llama.generate(PROMPTS[2], max_tokens=8, temperature=1.0, seed=12).token_ids


def test_stop_strings_end_the_text_before_them(llama):
    full = llama.generate(PROMPTS[1], max_tokens=24)
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llama.generate(PROMPTS[1], max_tokens=24, stop=[stop, "never appears ~~~"])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    assert stop not in cut.text
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids


def test_an_end_of_sequence_token_stops_and_is_left_out(files, shared_rt):
    model = load_model(files["llama"])
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV) as llm:
        full = llm.generate(PROMPTS[0], max_tokens=10)
    third = full.token_ids[2]
    model.config = dataclasses.replace(model.config, eos_token_ids=(third,))
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV) as llm:
        c = llm.generate(PROMPTS[0], max_tokens=10)
        assert c.finish_reason == "stop"
        assert c.token_ids == full.token_ids[:full.token_ids.index(third)]
        assert idle(llm)


def test_max_seq_len_ends_with_length(files, shared_rt):
    with LLM(files["llama"], runtime=shared_rt, kv_cache_bytes=KV, max_seq_len=12) as llm:
        ids = llm.encode(PROMPTS[1])
        c = llm.generate(ids, max_tokens=100)
        assert c.finish_reason == "length"
        assert len(ids) + len(c.token_ids) == 12


@pytest.mark.anyio
async def test_stream_pieces_add_up_to_the_completion(llama):
    want = await llama.agenerate(PROMPTS[2], max_tokens=14)
    pieces = [p async for p in llama.stream(PROMPTS[2], max_tokens=14)]
    assert all(isinstance(p, StreamPiece) for p in pieces)
    assert "".join(p.text for p in pieces) == want.text
    assert [p.token_id for p in pieces if p.token_id is not None] == want.token_ids
    assert [p.finish_reason for p in pieces[:-1]] == [None] * (len(pieces) - 1)
    assert pieces[-1].finish_reason == want.finish_reason
    assert idle(llama)


@pytest.mark.anyio
async def test_concurrent_streams_share_the_cache(llama):
    alone = [(await llama.agenerate(p, max_tokens=8)).token_ids for p in PROMPTS]
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        got[i] = [p.token_id async for p in llama.stream(PROMPTS[i], max_tokens=8) if p.token_id is not None]

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert idle(llama)


@pytest.mark.anyio
async def test_leaving_a_stream_early_frees_its_blocks(llama):
    n = 0
    async with contextlib.aclosing(llama.stream(PROMPTS[0], max_tokens=50)) as stream:
        async for _ in stream:
            n += 1
            assert llama.engine.reserved_blocks > 0
            if n == 3:
                break
    assert idle(llama)


def test_chat_renders_the_template(llama):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert llama.apply_chat_template(msgs).endswith("<|im_start|>assistant\n")
    c = llama.chat(msgs, max_tokens=6)
    assert c.token_ids == llama.generate(llama.model.chat_ids(msgs), max_tokens=6).token_ids


def test_bad_requests_are_refused_and_leave_nothing_held(llama):
    cases = [
        (dict(prompt=""), "no tokens"),
        (dict(prompt=[]), "empty list"),
        (dict(prompt=[1, 10 ** 6]), "out of range"),
        (dict(prompt=3.5), "must be a str"),
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", temperature=-1), "temperature"),
        (dict(prompt="x", temperature=float("nan")), "temperature"),
        (dict(prompt="x", top_p=0), "top_p"),
        (dict(prompt="x", top_k=-2), "top_k"),
        (dict(prompt="x", seed="s"), "seed"),
        (dict(prompt="x", stop=[""]), "stop"),
        (dict(prompt="x", stop=5), "stop"),
        (dict(prompt=[1] * 300), "max_seq_len"),
    ]
    for kw, words in cases:
        prompt = kw.pop("prompt")
        with pytest.raises(InputError, match=words):
            llama.generate(prompt, **kw)
    assert idle(llama)


def test_max_seq_len_is_what_the_cache_holds_and_no_more(files, shared_rt):
    with LLM(files["llama"], runtime=shared_rt, kv_cache_bytes=8 * 1024 * 5) as llm:
        assert llm.max_seq_len == llm.engine.capacity_tokens == 64
        ids = llm.encode(PROMPTS[1])
        c = llm.generate(ids, max_tokens=200)
        assert c.finish_reason == "length" and len(ids) + len(c.token_ids) == 64
        assert idle(llm)
    with pytest.raises(KVCacheFullError, match="max_seq_len"):
        LLM(files["llama"], runtime=shared_rt, kv_cache_bytes=8 * 1024 * 5, max_seq_len=1000)


def test_bad_arguments(files, shared_rt):
    for kw in (dict(max_batch_tokens=0), dict(max_seq_len=1), dict(kv_cache_bytes=-1), dict(kv_cache_dtype="f8")):
        with pytest.raises(ValueError):
            LLM(files["llama"], runtime=shared_rt, **kw)


def test_f16_kv_cache(files, shared_rt):
    with LLM(files["llama"], runtime=shared_rt, kv_cache_bytes=KV, kv_cache_dtype="f16") as llm:
        ids = llm.encode(PROMPTS[1])
        close_logits(llm.logits(ids), reference_logits(llm.model, ids), 2e-3)


def test_attention_combined_by_the_output_projection_keeps_greedy_tokens(files, shared_rt, monkeypatch):
    """ATTN_COMBINE_IN_LINEAR: split attention goes to the output projection uncombined, the decode
    steps' GEMV combines it on load (a combine pass runs only for the prompt's rows, on the tiled
    path), and greedy generation still equals the reference."""
    from hetero.kernels import decoder as D
    monkeypatch.setattr(D, "ATTN_COMBINE_IN_LINEAR", True)
    monkeypatch.setattr(D, "ATTN_SPLIT_KEYS", 16)  # a split a block of keys
    monkeypatch.setattr(D, "GEMV_IMPL", "units")   # the tiny model's rows are short: lanes otherwise
    seen: dict[str, list[int]] = {"splits": [], "combines": []}
    linear, combine = D.linear, D.combine_attention

    def counting_linear(gpu, x, *a, **kw):
        if isinstance(x, D.AttentionSplits):
            seen["splits"].append(x.shape[0])
        return linear(gpu, x, *a, **kw)

    def counting_combine(gpu, x):
        seen["combines"].append(x.shape[0])
        return combine(gpu, x)
    monkeypatch.setattr(D, "linear", counting_linear)
    monkeypatch.setattr(D, "combine_attention", counting_combine)
    with LLM(files["llama"], runtime=shared_rt, kv_cache_bytes=KV) as llm:
        ids = llm.encode(PROMPTS[1] + " " + PROMPTS[2])
        c = llm.generate(ids, max_tokens=16)
        assert c.token_ids == reference_greedy(llm.model, ids, 16)[:len(c.token_ids)] and len(c.token_ids) > 8
    decode = [t for t in seen["splits"] if t <= D.GEMV_MAX_M]
    assert decode and all(t > D.GEMV_MAX_M for t in seen["combines"]), seen


def test_swiglu_quantized_for_down_keeps_greedy_tokens(files, shared_rt, monkeypatch):
    """SWIGLU_QUANTIZES with every product on the dp4a GEMM and K split: the prompt's step hands
    gate/up's output to down as QuantizedRows (decode steps, on the GEMV, do not), and the tokens
    are those of the same settings without it."""
    from hetero.kernels import decoder as D
    monkeypatch.setattr(D, "TILED_IMPL", "dp4a")
    monkeypatch.setattr(D, "TILED_MIN_GROUPS", 1 << 20)
    monkeypatch.setattr(D, "TILED_SPLIT_MIN_CHUNKS", 1)
    asked: list[bool] = []
    swiglu = D.linear_swiglu

    def counting(gpu, x, *a, quantize=False, **kw):
        asked.append(quantize)
        return swiglu(gpu, x, *a, quantize=quantize, **kw)
    monkeypatch.setattr(D, "linear_swiglu", counting)
    tokens = {}
    for on in (False, True):
        monkeypatch.setattr(D, "SWIGLU_QUANTIZES", on)
        with LLM(files["q4_1"], runtime=shared_rt, kv_cache_bytes=KV) as llm:
            ids = llm.encode(PROMPTS[1] + " " + PROMPTS[0])
            assert len(ids) > D.GEMV_MAX_M
            tokens[on] = llm.generate(ids, max_tokens=12).token_ids
    assert tokens[True] == tokens[False] and len(tokens[True]) > 4
    assert True in asked and asked.count(True) < len(asked)  # the prompt's steps only


def test_own_runtime_closes_with_the_llm(files):
    llm = LLM(files["tied"], kv_cache_bytes=KV)
    rt = llm.runtime
    assert llm.generate("A", max_tokens=2).completion_tokens == 2
    llm.close()
    with pytest.raises(RuntimeClosedError):
        llm.generate("A")
    g = hetero.Graph()
    g.output(g.cpu(abs, g.input("x")))
    with pytest.raises(RuntimeClosedError):
        anyio.run(lambda: rt.run(g, x=-1))


@pytest.mark.anyio
async def test_sync_calls_inside_a_loop_are_refused(llama):
    with pytest.raises(hetero.HeteroError, match="agenerate"):
        llama.generate("A")


def test_smollm2_answers_paris(shared_rt):
    with LLM("smollm2", runtime=shared_rt, kv_cache_bytes=16 << 20) as llm:
        c = llm.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=8)
        ids = llm.model.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
        assert c.token_ids == reference_greedy(llm.model, ids, 8, stop_at_eos=True)[:len(c.token_ids)]
        assert "Paris" in c.text


def test_generate_command_streams_text_and_summarises(files, capsys, tmp_path):
    from hetero._cli import main

    with LLM(files["llama"], kv_cache_bytes=KV) as llm:
        want = llm.generate(PROMPTS[1], max_tokens=9)
    assert main(["generate", "--model", str(files["llama"]), "--prompt", PROMPTS[1], "--max-tokens", "9"]) == 0
    got = capsys.readouterr()
    assert got.out == want.text + "\n"
    assert f"generated {len(want.token_ids)} tokens ({want.finish_reason})" in got.err
    assert "adapter:" in got.err
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPTS[1] + "\n", encoding="utf-8")
    assert main(["generate", "--model", str(files["llama"]), "--input", str(prompt), "--max-tokens", "9"]) == 0
    assert capsys.readouterr().out == want.text + "\n"


def test_generate_command_errors(files, capsys):
    from hetero._cli import main

    assert main(["generate", "--model", "/no/such/model.gguf", "--prompt", "x"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(files["llama"]), "--prompt", "x", "--top-p", "0"]) == 1
    assert "--top-p" in capsys.readouterr().err
    assert main(["generate", "--model", str(files["llama"]), "--prompt", "x", "--temperature", "-1"]) == 2
    assert main(["generate", "--model", str(files["llama"]), "--input", "/no/such/file"]) == 1
    assert "cannot read" in capsys.readouterr().err
