"""The ``hetero`` command line, called in-process through ``hetero._cli.main``."""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import hetero
from hetero import _cli
from hetero._gpu import device as _device


def adapter_names() -> list[str]:
    return [_device.adapter_summary(a)["name"] for a in _device.list_adapters()]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"hetero {hetero.__version__} (wgpu ")


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main([]) == 2
    assert "required: command" in capsys.readouterr().err


def test_info(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETERO_ADAPTER", raising=False)
    assert _cli.main(["info"]) == 0
    out = capsys.readouterr().out
    chosen = _device.select_adapter()
    assert f"selected: {chosen.summary}" in out
    assert "<- selected" in out
    for name in adapter_names():
        assert name in out
    for limit in _cli.KEY_LIMITS:
        assert limit in out
    assert "compute features enabled: timestamp-query " in out
    assert "adapter features: " in out


def test_info_prints_each_adapters_selector() -> None:
    import io

    adapters = _device.list_adapters()
    labels = _device.adapter_labels(adapters)
    out = io.StringIO()
    _cli._print_adapters(out, adapters, None, _device.adapter_index(adapters, labels[-1]))
    rows = out.getvalue().splitlines()
    assert [ln[4:].split()[0] for ln in rows] == labels
    assert rows[-1].startswith(f"  * {labels[-1]} ") and rows[-1].endswith("<- selected")
    assert [ln for ln in rows if "<- selected" in ln] == rows[-1:]


def test_info_respects_hetero_adapter(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    summary = _device.select_adapter().summary
    backend = summary.rsplit(" via ", 1)[-1]
    monkeypatch.setenv("HETERO_ADAPTER", backend.lower())
    assert _cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"via {backend} (HETERO_ADAPTER={backend.lower()!r})" in out


def test_info_with_unknown_adapter_fails_clearly(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETERO_ADAPTER", "no-such-gpu-xyz")
    assert _cli.main(["info"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hetero: error: no adapter matches HETERO_ADAPTER='no-such-gpu-xyz'; available: ")
    assert "Traceback" not in err


def test_info_without_adapters_says_what_to_install(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device, "list_adapters", lambda: [])
    assert _cli.main(["info"]) == 1
    assert "apt-get install -y mesa-vulkan-drivers" in capsys.readouterr().err
    assert _cli.main(["info", "--check"]) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert out.startswith("no compute-capable Vulkan, Metal or D3D12 adapter (adapters: none)")
    assert "apt-get install -y mesa-vulkan-drivers" in out


def test_info_check(capsys: pytest.CaptureFixture[str]) -> None:
    has_compute_backend = any(
        _device.adapter_summary(a)["backend"] in _cli.COMPUTE_BACKENDS for a in _device.list_adapters()
    )
    code = _cli.main(["info", "--check"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert code == (0 if has_compute_backend else 1)
    if code == 0:
        assert out.startswith("ok: compute works on ")


def test_demo(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETERO_ADAPTER", raising=False)
    assert _cli.main(["demo", "--size", "1000", "--runs", "3"]) == 0
    out = capsys.readouterr().out
    assert f"adapter: {_device.select_adapter().summary}" in out
    assert "1 run + 3 through Runtime.map" in out
    for stage, kind in (("prepare", "cpu"), ("saxpy", "gpu"), ("check", "cpu")):
        assert f"  {stage:<8} {kind} " in out
    assert "result: matches numpy in all 4 runs" in out


def test_demo_error_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # A stage failure surfaces as StageError -> "hetero: error: ..." and exit status 1.
    monkeypatch.setattr(_cli, "SAXPY_WGSL", "this is not WGSL")
    assert _cli.main(["demo", "--size", "10", "--runs", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hetero: error: gpu stage 'saxpy' failed: ")
    assert "Traceback" not in err


def test_demo_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["demo", "--size", "0"]) == 2
    assert "argument --size: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_python_dash_m() -> None:
    done = subprocess.run([sys.executable, "-m", "hetero", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout.startswith("hetero ")


def test_demo_writes_a_trace(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    path = tmp_path / "demo.json"
    assert _cli.main(["demo", "--size", "1000", "--runs", "2", "--trace", str(path)]) == 0
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("cat") == "gpu-record" for e in events) and any(e.get("cat") == "cpu" for e in events)


def test_demo_checks_its_trace_path_before_any_work(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing" / "t.json"
    assert _cli.main(["demo", "--size", "1000", "--runs", "1", "--trace", str(missing)]) == 1
    got = capsys.readouterr()
    assert got.out == ""  # nothing ran: the demo prints its adapter first
    assert got.err == (f"hetero: error: cannot write trace file {str(missing)!r}: directory "
                       f"{str(missing.parent)!r} does not exist\n")
    assert _cli.main(["demo", "--trace", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"hetero: error: cannot write trace file {str(tmp_path)!r}: it is a directory\n"
    # Permissions do not stop root; a file system that refuses new files stops everyone.
    assert _cli.main(["demo", "--trace", "/sys/hetero-trace.json"]) == 1
    got = capsys.readouterr()
    assert got.err.startswith("hetero: error: cannot write trace file '/sys/hetero-trace.json': ")
    assert got.err.count("\n") == 1 and got.out == ""


def _docstring_sentences(limit: int) -> list[str]:
    """Sentences of the standard library's docstrings: text this project did not write."""
    import argparse
    import collections
    import functools
    import json
    import pathlib
    import textwrap

    out: list[str] = []
    for mod in (collections, json, textwrap, pathlib, functools, argparse, subprocess, inspect):
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj)
            if doc:
                out += [s for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())) if s]
    return out[:limit]


def _wait_for(proc: subprocess.Popen[bytes], ready: Any) -> None:
    deadline = time.monotonic() + 120  # a guard against a hang, not a measurement
    while not ready():
        assert proc.poll() is None, f"hetero embed ended before the interrupt: {proc.communicate()}"
        assert time.monotonic() < deadline, "hetero embed never got there"
        time.sleep(0.01)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="watches the process through /proc")
def test_ctrl_c_during_embed_always_ends_with_interrupted(tmp_path: Path) -> None:
    """SIGINT while the weights load, while the device starts, and while batches run and submit:
    every time it ends with the line ``hetero: interrupted`` and exit status 130, never an abort or
    a traceback. (A warning may come before it: on a loaded machine a stage can still be compiling
    kernels when the run gives up waiting for it.)"""
    from hetero.pipelines.testing import write_random_model

    model = write_random_model(tmp_path / "m", seed=3, vocab_size=300, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                               max_seq_length=48)
    src = tmp_path / "in.txt"
    # Far more text than the job gets through before the last interrupt, however fast the machine.
    src.write_text("\n".join(_docstring_sentences(2000) * 20) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"

    def loading_weights(pid: int) -> bool:  # main() runs: safetensors is imported only to load a model
        return "safetensors" in Path(f"/proc/{pid}/maps").read_text()

    def device_starting(pid: int) -> bool:  # the Vulkan loader comes in when the device is created
        return "libvulkan" in Path(f"/proc/{pid}/maps").read_text()

    # Then the kernels compile, and a little later batches are recorded and submitted.
    for ready, delay in ((loading_weights, 0.0), (device_starting, 0.0), (device_starting, 0.5),
                         (device_starting, 1.5)):
        proc = subprocess.Popen([sys.executable, "-m", "hetero", "embed", "--model", str(model), "--input", str(src),
                                 "--output", str(out), "--batch-size", "4"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)
        try:
            _wait_for(proc, lambda: ready(proc.pid))
            time.sleep(delay)
            assert proc.poll() is None, f"hetero embed ended before the interrupt: {proc.communicate()}"
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        err = stderr.decode()
        assert (ready.__name__, delay, proc.returncode, err.splitlines()[-1:], stdout.decode()) == \
            (ready.__name__, delay, 130, ["hetero: interrupted"], ""), err
        assert "Traceback" not in err and "panicked" not in err, err
        assert not out.exists()


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C acts as in a foreground program, even where the test
    run itself was started with SIGINT ignored (a background job of a non-interactive shell)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupts_held_until_the_teardown_ends() -> None:
    from hetero.pipelines import embed_cli

    steps: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a program started in the foreground
    try:
        with pytest.raises(KeyboardInterrupt):
            with embed_cli.interrupts_held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here: held, not raised
                steps.append("teardown finished")
        assert steps == ["teardown finished"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    with embed_cli.interrupts_held():  # nothing arrived: nothing raised
        steps.append("again")
    assert steps == ["teardown finished", "again"]


def test_an_interrupt_python_ignores_is_delivered_again() -> None:
    """A KeyboardInterrupt raised where Python only reports exceptions (a __del__ here; a weakref
    callback of the import system in the wild) is not lost: the command line's hook signals the main
    thread again and the interrupt is raised in the code that runs next. Outside the hook, it is lost."""
    from hetero._cli import _interrupts_redelivered

    class Dies:
        def __del__(self) -> None:
            raise KeyboardInterrupt

    def spin(seconds: float) -> None:  # ordinary code the re-delivered interrupt lands in
        deadline = time.monotonic() + seconds  # a guard against a lost interrupt, not a measurement
        while time.monotonic() < deadline:
            time.sleep(0.001)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground program
    try:
        with pytest.raises(KeyboardInterrupt):
            with _interrupts_redelivered():
                Dies()
                spin(60.0)
        hooks: list[Any] = []
        before, sys.unraisablehook = sys.unraisablehook, hooks.append
        try:
            Dies()  # without the hook: reported (here: collected) and lost
            spin(0.2)
        finally:
            sys.unraisablehook = before
        assert [h.exc_type for h in hooks] == [KeyboardInterrupt]
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="watches the process through /proc")
def test_ctrl_c_during_imports_and_runs_ends_with_interrupted() -> None:
    """SIGINT while numpy is being imported, while wgpu is, and while the demo's runs go on: each
    time the line ``hetero: interrupted``, exit status 130 and no traceback. The points are found
    by watching the process's mapped libraries, so a loaded machine moves them, not the outcome."""
    def mapped(name: str) -> Any:
        return lambda pid: name in Path(f"/proc/{pid}/maps").read_text()

    for what, ready, delay in (("numpy import", mapped("_multiarray_umath"), 0.0),
                               ("wgpu import", mapped("wgpu_native"), 0.0),
                               ("runs", mapped("libvulkan"), 0.5)):
        proc = subprocess.Popen([sys.executable, "-m", "hetero", "demo", "--size", "1000", "--runs", "1000000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)
        try:
            _wait_for(proc, lambda: ready(proc.pid))
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        err = stderr.decode()
        assert (what, proc.returncode, err.splitlines()[-1:]) == (what, 130, ["hetero: interrupted"]), err
        assert "Traceback" not in err, err
