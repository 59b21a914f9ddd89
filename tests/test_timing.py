"""GPU timestamps on the CI software GPU (lavapipe): spans, strategies, alignment, the disabled path."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import wgpu

from hetero._gpu.device import select_adapter
from hetero._gpu.timing import CHUNK, ClockAlignment, GPUSpan, GPUTimer

ALL = ["timestamp-query", "timestamp-query-inside-encoders", "timestamp-query-inside-passes"]

# One workgroup of one invocation running an LCG N times: GPU time grows with N.
LOOP = """
@group(0) @binding(0) var<storage, read_write> y: array<u32>;
override N: u32 = 1u;
@compute @workgroup_size(1)
fn main() {
    var acc = y[1];
    for (var i = 0u; i < N; i++) { acc = acc * 1664525u + 1013904223u + i; }
    y[0] = acc;
}
"""
LONG = 2_000_000


@pytest.fixture(scope="module")
def adapter() -> Any:
    a = select_adapter()
    if "timestamp-query" not in a.features:
        pytest.skip(f"{a.summary} has no timestamp-query")
    return a


@pytest.fixture(scope="module")
def device(adapter: Any) -> Any:
    features = [f for f in ALL if f in adapter.features]
    return adapter.request_device_sync(required_features=features)


class Loops:
    """Pipelines for N = 1 and N = LONG over one storage buffer, run once each (lavapipe JITs on first use)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        module = device.create_shader_module(code=LOOP)
        self.buffer = device.create_buffer(size=16, usage=wgpu.BufferUsage.STORAGE)
        self.kernels: dict[int, tuple[Any, Any]] = {}
        for n in (1, LONG):
            p = device.create_compute_pipeline(layout="auto",
                                               compute={"module": module, "entry_point": "main", "constants": {"N": n}})
            bg = device.create_bind_group(layout=p.get_bind_group_layout(0),
                                          entries=[{"binding": 0, "resource": {"buffer": self.buffer}}])
            self.kernels[n] = (p, bg)
        e = device.create_command_encoder()
        cp = e.begin_compute_pass()
        for n in self.kernels:
            self.dispatch(cp, n)
        cp.end()
        device.queue.submit([e.finish()])

    def dispatch(self, cpass: Any, n: int) -> None:
        p, bg = self.kernels[n]
        cpass.set_pipeline(p)
        cpass.set_bind_group(0, bg)
        cpass.dispatch_workgroups(1)


@pytest.fixture(scope="module")
def loops(device: Any) -> Loops:
    return Loops(device)


@pytest.fixture(scope="module")
def timer(device: Any) -> Iterator[GPUTimer]:
    t = GPUTimer(device)
    yield t
    t.close()


def submit_and_read(timer: GPUTimer, encoder: Any, ticket: Any) -> tuple[list[GPUSpan], int, int]:
    command_buffer = encoder.finish()
    t0 = time.perf_counter_ns()
    timer.device.queue.submit([command_buffer])
    spans = timer.read(ticket)  # mapping waits for the submission
    return spans, t0, time.perf_counter_ns()


def test_strategy_and_tick_period(timer: GPUTimer, device: Any) -> None:
    assert timer.available
    if {"timestamp-query-inside-passes", "timestamp-query-inside-encoders"} <= device.features:
        assert timer.strategy == "inside-passes"
    assert timer.period_ns > 0
    # The period is right: device time between two round trips lies within the host interval
    # that encloses both, and contains the one between them (sound however loaded the host is).
    frame = timer.frame()
    a = timer._sample(frame, device.queue.submit)
    time.sleep(0.05)
    b = timer._sample(frame, device.queue.submit)
    assert a is not None and b is not None
    (a0, a1, ga), (b0, b1, gb) = a, b
    assert a0 <= a1 < b0 <= b1
    assert b0 - a1 <= gb - ga <= b1 - a0, (a, b)
    ratio = timer.measure_period(gap=0.01, samples=1)
    assert ratio is not None and ratio > 0


def test_per_dispatch_spans_in_a_shared_pass(timer: GPUTimer, device: Any, loops: Loops) -> None:
    """Marks inside one open compute pass give each dispatch its own span, in command order,
    nested in the encoder's span; a span brackets its dispatch's work."""
    if timer.strategy != "inside-passes":
        pytest.skip("needs timestamp-query-inside-passes")
    frame = timer.frame()
    encoder = device.create_command_encoder()
    whole = frame.begin(encoder, "encoder")
    cpass = encoder.begin_compute_pass()
    for label, n in (("short-a", 1), ("long", LONG), ("short-b", 1)):
        with frame.time(cpass, label, meta=n):
            loops.dispatch(cpass, n)
    cpass.end()
    frame.end(encoder, whole)
    ticket = frame.resolve(encoder)
    assert frame.empty
    spans, _, _ = submit_and_read(timer, encoder, ticket)
    assert [s.label for s in spans] == ["encoder", "short-a", "long", "short-b"]
    assert [s.meta for s in spans] == [None, 1, LONG, 1]  # carried through for the tracer
    for s in spans:
        assert s.end_ns >= s.start_ns
    inner = spans[1:]
    for a, b in zip(inner, inner[1:]):
        assert b.start_ns >= a.end_ns  # in command order
    assert spans[0].start_ns <= inner[0].start_ns and inner[-1].end_ns <= spans[0].end_ns
    # The long loop's marks were written before and after real work: not at one instant.
    assert inner[1].end_ns > inner[1].start_ns
    assert timer.free_slots == timer.capacity


def test_alignment_puts_spans_between_submit_and_fence(timer: GPUTimer, device: Any, loops: Loops) -> None:
    alignment = timer.align(samples=5)
    assert alignment is not None and alignment.samples >= 1
    assert alignment.lo_ns <= alignment.hi_ns and alignment.error_ns >= 0
    frame = timer.frame()
    encoder = device.create_command_encoder()
    cpass = encoder.begin_compute_pass(timestamp_writes=frame.pass_writes("pass", meta=("run", 7)))
    loops.dispatch(cpass, LONG)
    cpass.end()
    spans, t0, t1 = submit_and_read(timer, encoder, frame.resolve(encoder))
    assert [s.label for s in spans] == ["pass"]
    (host,) = timer.to_host(spans)
    assert host.meta == ("run", 7)
    # The alignment's interval holds the true offset (device and host read the same clock on
    # lavapipe, 200 µs allow for drift elsewhere): the span maps into the submission's window.
    slack = alignment.error_ns + 200_000
    assert t0 - slack <= host.start_ns <= host.end_ns <= t1 + slack, (t0, host, t1, alignment)
    # a real submission narrows the interval, never widens it
    timer.observe(spans, t0, t1)
    assert timer.alignment is not None and timer.alignment.error_ns <= alignment.error_ns


def test_frames_on_several_threads(timer: GPUTimer, device: Any, loops: Loops) -> None:
    """Each recording thread keeps its own frame; slots never collide and all come back."""
    results: dict[int, list[GPUSpan]] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            out: list[GPUSpan] = []
            for _ in range(5):
                frame = timer.frame()
                encoder = device.create_command_encoder()
                cpass = encoder.begin_compute_pass(timestamp_writes=frame.pass_writes(f"t{k}"))
                loops.dispatch(cpass, 1)
                cpass.end()
                for i in range(40):  # more than one chunk of slots
                    frame.mark(encoder, f"m{i}")
                ticket = frame.resolve(encoder)
                spans, _, _ = submit_and_read(timer, encoder, ticket)
                out.extend(spans)
            results[k] = out
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    marks = 40 if timer.in_encoders else 0
    for k, spans in results.items():
        assert len(spans) == 5 * (1 + marks)
        assert all(s.end_ns >= s.start_ns > 0 for s in spans)
        assert {s.label for s in spans} >= {f"t{k}"}
    assert timer.free_slots == timer.capacity


def test_full_query_set_drops_spans_without_breaking_the_encoder(device: Any, loops: Loops) -> None:
    timer = GPUTimer(device, capacity=CHUNK)
    holder = timer.frame()
    encoder0 = device.create_command_encoder()
    assert holder.pass_writes("holds the only chunk") is not None
    assert timer.free_slots == 0
    frame = timer.frame()
    encoder = device.create_command_encoder()
    assert frame.pass_writes("none left") is None
    assert frame.begin(encoder, "none left") == -1
    frame.end(encoder, -1)
    assert frame.resolve(encoder) is None
    assert timer.dropped == 2
    encoder.finish()  # nothing was written into it
    holder.discard()  # the reserved pair was never written: give it back unresolved
    encoder0.finish()
    assert timer.free_slots == CHUNK
    # one frame filling the whole set: the overflow is dropped, the rest reads back
    if timer.in_encoders:
        frame = timer.frame()
        encoder = device.create_command_encoder()
        for i in range(CHUNK + 5):
            frame.mark(encoder, f"m{i}")
        spans, _, _ = submit_and_read(timer, encoder, frame.resolve(encoder))
        assert [s.label for s in spans] == [f"m{i}" for i in range(CHUNK)]
        assert timer.dropped == 7
    timer.close()


def test_core_timestamp_query_only(adapter: Any, loops: Loops) -> None:
    """With only core timestamp-query, marks are refused (they would poison the encoder) and
    pass timestamp_writes still time passes."""
    device = adapter.request_device_sync(required_features=["timestamp-query"])
    timer = GPUTimer(device)
    assert timer.available and timer.strategy == "pass-writes"
    assert not timer.in_passes and not timer.in_encoders
    looped = Loops(device)
    frame = timer.frame()
    encoder = device.create_command_encoder()
    assert frame.begin(encoder, "refused") == -1
    cpass = encoder.begin_compute_pass(timestamp_writes=frame.pass_writes("pass"))
    assert frame.mark(cpass, "refused") == -1
    looped.dispatch(cpass, LONG)
    cpass.end()
    spans, _, _ = submit_and_read(timer, encoder, frame.resolve(encoder))  # finish() did not raise
    assert [s.label for s in spans] == ["pass"] and spans[0].end_ns > spans[0].start_ns
    assert timer.align(samples=2) is not None  # aligns through an empty timed pass
    timer.close()


def test_disabled_timer_is_a_no_op(adapter: Any) -> None:
    device = adapter.request_device_sync(required_features=[])
    timer = GPUTimer(device)
    assert not timer.available and timer.strategy is None and timer.query_set is None
    frame = timer.frame()
    encoder = device.create_command_encoder()
    assert frame.pass_writes("x") is None and timer.begin_pass_writes("x") is None
    cpass = encoder.begin_compute_pass(timestamp_writes=frame.pass_writes("x"))
    assert frame.begin(cpass, "x") == -1 and frame.mark(cpass, "x") == -1
    with frame.time(cpass, "x"):
        pass
    cpass.end()
    assert timer.mark(encoder, "x") == -1
    assert frame.resolve(encoder) is None and timer.resolve(encoder) is None
    device.queue.submit([encoder.finish()])
    assert timer.read(None) == []
    assert timer.align() is None and timer.measure_period() is None
    assert timer.to_host([GPUSpan("a", 1, 2)]) == [GPUSpan("a", 1, 2)]
    assert GPUTimer(object()).available is False  # anything without features


def test_capacity_is_checked(device: Any) -> None:
    with pytest.raises(ValueError, match="timer capacity must be an int from 32 to 4096, got 5000"):
        GPUTimer(device, capacity=5000)


def test_clock_alignment_intervals() -> None:
    a = ClockAlignment(100, 300)
    assert a.offset_ns == 200 and a.error_ns == 100 and a.to_host(1000) == 1200
    b = a.refine(150, 400)
    assert (b.lo_ns, b.hi_ns, b.samples) == (150, 300, 2)
    c = b.refine(500, 600)  # disjoint: the clocks drifted; start over
    assert (c.lo_ns, c.hi_ns, c.samples) == (500, 600, 1)
    with pytest.raises(ValueError, match=r"clock alignment interval is empty: \[2, 1\]"):
        ClockAlignment(2, 1)


def test_read_does_not_wait_for_the_promise_poll_thread(timer: GPUTimer, device: Any, loops: Loops) -> None:
    """Reading the timestamps of finished work maps their buffer with a poll of its own: it does
    not wait for wgpu-py's poll thread, which may sit in a poll that returns only once every
    submission in flight has finished (here it is held until the end of the test)."""
    frame = timer.frame()
    encoder = device.create_command_encoder()
    frame.mark(encoder, "done")
    ticket = frame.resolve(encoder)
    device.queue.submit([encoder.finish()])
    device._poll_wait()  # a blocking poll: the work is finished before the read

    poller = device._poller
    held, released = threading.Event(), threading.Event()
    original = poller._poll_func

    def stuck_poll(block: bool) -> None:  # the poll thread, stuck as behind a long GPU job
        held.set()
        released.wait()

    poller._poll_func = stuck_poll
    token = poller.get_token()  # wakes the poll thread, into the stuck poll
    got: list[list[GPUSpan]] = []
    reader = threading.Thread(target=lambda: got.append(timer.read(ticket)), daemon=True)
    try:
        assert held.wait(timeout=30)
        reader.start()
        reader.join(timeout=30)  # a guard against hanging the suite, not a measurement
        finished = not reader.is_alive()
    finally:
        poller._poll_func = original
        token.set_done()
        released.set()
        if reader.ident is not None:
            reader.join()
    assert finished
    assert [s.label for s in got[0]] == ["done"]
