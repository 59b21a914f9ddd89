"""The trace recorder: output follows the trace-event rules Perfetto and chrome://tracing expect."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hetero._trace import GPU_DISPATCHES, GPU_QUEUE, Tracer

NUMBER = (int, float)


def check_trace(data: dict[str, Any]) -> dict[int, str]:
    """Assert the Trace Event Format rules; return the thread names by tid."""
    assert set(data) >= {"traceEvents", "displayTimeUnit", "otherData"}
    assert data["displayTimeUnit"] in ("ms", "ns")
    events = data["traceEvents"]
    assert isinstance(events, list)
    names: dict[int, str] = {}
    processes: dict[int, str] = {}
    used: set[tuple[int, int]] = set()
    flows: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for ev in events:
        assert isinstance(ev, dict)
        for key in ("ph", "name", "pid", "tid", "ts"):
            assert key in ev, (key, ev)
        assert isinstance(ev["name"], str) and isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert isinstance(ev["ts"], NUMBER)
        ph = ev["ph"]
        assert ph in ("X", "i", "C", "M", "s", "f"), ev
        if ph == "M":
            assert ev["name"] in ("process_name", "thread_name", "thread_sort_index"), ev
            if ev["name"] == "thread_name":
                assert isinstance(ev["args"]["name"], str) and ev["args"]["name"]
                assert ev["tid"] not in names, f"thread {ev['tid']} named twice"
                names[ev["tid"]] = ev["args"]["name"]
            elif ev["name"] == "process_name":
                processes[ev["pid"]] = ev["args"]["name"]
            else:
                assert isinstance(ev["args"]["sort_index"], int)
            continue
        used.add((ev["pid"], ev["tid"]))
        if ph == "X":
            assert isinstance(ev["dur"], NUMBER) and ev["dur"] >= 0, ev
        elif ph == "i":
            assert ev["s"] in ("t", "p", "g")
        elif ph == "C":
            assert ev["args"] and all(isinstance(v, NUMBER) and not isinstance(v, bool) for v in ev["args"].values())
        else:
            assert "id" in ev and "cat" in ev
            flows.setdefault((ev["cat"], ev["name"], ev["id"]), []).append(ev)  # how Perfetto pairs them
        if "args" in ev:
            assert isinstance(ev["args"], dict)
    for pid, tid in used:
        assert pid in processes, f"process {pid} has no process_name"
        assert tid in names, f"track {tid} has no thread_name"
    for flow, pair in flows.items():
        assert sorted(e["ph"] for e in pair) == ["f", "s"], (flow, pair)
    return names


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def test_events_of_every_kind(tmp_path: Path) -> None:
    tr = Tracer(tmp_path / "t.json")
    now = time.perf_counter_ns()
    tr.name_thread("event loop")
    tr.span("plan", "sched", now, now + 5_000, args={"stages": 3})
    tr.instant("run start", "sched", now + 1_000)
    tr.counter("buffer pool", now + 2_000, {"in_use": 4096, "pooled": 65536})
    with tr.cpu_span("normalise", args={"run": 0}) as extra:
        extra["bytes"] = 64
    tr.gpu_span("affine", now + 10_000, now + 30_000, {"workgroups": 4})
    assert tr.write() == str(tmp_path / "t.json")
    data = load(tmp_path / "t.json")
    names = check_trace(data)
    events = [e for e in data["traceEvents"] if e["ph"] != "M"]
    by_name = {e["name"]: e for e in events}
    assert by_name["plan"]["dur"] == pytest.approx(5.0) and by_name["plan"]["args"] == {"stages": 3}
    assert by_name["plan"]["ts"] >= 0  # microseconds from the tracer's origin
    assert by_name["run start"]["ts"] == pytest.approx(by_name["plan"]["ts"] + 1.0)
    assert by_name["buffer pool"]["args"] == {"in_use": 4096.0, "pooled": 65536.0}
    assert by_name["normalise"]["args"] == {"run": 0, "bytes": 64} and by_name["normalise"]["cat"] == "cpu"
    assert by_name["affine"]["dur"] == pytest.approx(20.0) and by_name["affine"]["cat"] == "gpu"
    assert names[by_name["plan"]["tid"]] == "event loop"
    assert names[by_name["affine"]["tid"]] == GPU_QUEUE
    assert by_name["affine"]["tid"] != by_name["plan"]["tid"]
    assert data["otherData"]["origin_perf_counter_ns"] == tr.origin_ns
    # the GPU queue sorts after the threads
    order = {e["tid"]: e["args"]["sort_index"] for e in data["traceEvents"] if e["name"] == "thread_sort_index"}
    assert order[by_name["affine"]["tid"]] > order[by_name["plan"]["tid"]]


def test_negative_durations_are_clamped_and_errors_noted(tmp_path: Path) -> None:
    tr = Tracer(tmp_path / "t.json")
    now = time.perf_counter_ns()
    tr.span("backwards", "cpu", now, now - 1000)
    with pytest.raises(ZeroDivisionError):
        with tr.cpu_span("fails"):
            1 / 0
    data = load(tr.write())
    check_trace(data)
    by_name = {e["name"]: e for e in data["traceEvents"]}
    assert by_name["backwards"]["dur"] == 0
    assert by_name["fails"]["args"]["error"] == "ZeroDivisionError: division by zero"


def test_recording_never_raises(tmp_path: Path) -> None:
    tr = Tracer(tmp_path / "t.json")
    tr.counter("pool", None, {"in_use": "lots"})  # type: ignore[dict-item]  # not a number
    tr.span("bad args", "cpu", 0, 1, args=[1, 2])  # type: ignore[arg-type]
    tr.instant("bad", args=42)  # type: ignore[arg-type]
    assert tr.errors == 3
    data = load(tr.write())
    check_trace(data)
    assert data["otherData"]["recording_errors"] == 3


def test_many_threads(tmp_path: Path) -> None:
    """Eight named threads record concurrently: each gets its own track and every event lands."""
    tr = Tracer(tmp_path / "t.json")
    n_threads, per_thread = 8, 500
    barrier = threading.Barrier(n_threads)

    def work(k: int) -> None:
        barrier.wait()
        for j in range(per_thread):
            t0 = time.perf_counter_ns()
            tr.span(f"stage-{k}", "cpu", t0, time.perf_counter_ns(), args={"j": j})
            if j % 100 == 0:
                tr.gpu_span(f"gpu-{k}", t0, t0 + 10)
                tr.counter("pool", None, {"in_use": j})

    threads = [threading.Thread(target=work, args=(k,), name=f"hetero-cpu-{k}") for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = load(tr.write())
    names = check_trace(data)
    spans = [e for e in data["traceEvents"] if e["ph"] == "X" and e["name"].startswith("stage-")]
    assert len(spans) == n_threads * per_thread
    for k in range(n_threads):
        tids = {e["tid"] for e in spans if e["name"] == f"stage-{k}"}
        assert len(tids) == 1 and names[tids.pop()] == f"hetero-cpu-{k}"
        js = [e["args"]["j"] for e in spans if e["name"] == f"stage-{k}"]
        assert js == list(range(per_thread))  # one thread's events stay in its order
    gpu_tids = {e["tid"] for e in data["traceEvents"] if e["name"].startswith("gpu-")}
    assert len(gpu_tids) == 1 and names[gpu_tids.pop()] == GPU_QUEUE
    assert len(names) == n_threads + 1


def test_a_new_thread_gets_a_new_track(tmp_path: Path) -> None:
    """Threads that ran one after another (the OS may reuse their idents) stay apart."""
    tr = Tracer(tmp_path / "t.json")
    for k in range(3):
        t = threading.Thread(target=lambda: tr.instant("hello"), name=f"hetero-gpu-{k}")
        t.start()
        t.join()
    names = check_trace(load(tr.write()))
    assert sorted(names.values()) == ["hetero-gpu-0", "hetero-gpu-1", "hetero-gpu-2"]


def test_flow_from_a_submission_to_its_gpu_span(tmp_path: Path) -> None:
    tr = Tracer(tmp_path / "t.json")
    now = time.perf_counter_ns()
    flow = tr.new_flow()
    assert tr.new_flow() != flow
    tr.span("record affine", "gpu-record", now, now + 4_000, flow_out=flow)
    tr.gpu_span("affine", now + 10_000, now + 12_000, flow_in=flow)
    data = load(tr.write())
    check_trace(data)
    evs = {e["ph"]: e for e in data["traceEvents"] if e["ph"] in ("s", "f", "X")}
    spans = {e["name"]: e for e in data["traceEvents"] if e["ph"] == "X"}
    s, f = evs["s"], evs["f"]
    assert s["id"] == f["id"] == flow and s["cat"] == f["cat"] and s["name"] == f["name"]
    assert f["bp"] == "e"
    for ev, span in ((s, spans["record affine"]), (f, spans["affine"])):
        assert ev["tid"] == span["tid"]
        assert span["ts"] < ev["ts"] < span["ts"] + span["dur"]  # bound to the enclosing slice


def test_writing_again_rewrites_the_whole_file(tmp_path: Path) -> None:
    """One file per tracer: each write holds every event so far, metadata once."""
    path = tmp_path / "trace.json"
    tr = Tracer(path)
    now = time.perf_counter_ns()
    tr.span("run 0", "run", now, now + 1000)
    tr.write()
    first = load(path)
    check_trace(first)
    tr.span("run 1", "run", now + 2000, now + 3000)
    tr.write()
    second = load(path)
    check_trace(second)  # thread_name once per track, despite two writes
    names = [e["name"] for e in second["traceEvents"] if e["ph"] == "X"]
    assert names == ["run 0", "run 1"]
    # events are encoded once, at the first write after them; the file is still the whole trace
    tr.name_thread("a track named after the first write")
    tr.counter("memory", now + 2500, {"in_use": 3})
    tr.write()
    assert load(path) == json.loads(json.dumps(tr.to_json(), default=repr))
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary files left
    # maybe_write throttles rewrites at run ends
    assert not tr.maybe_write(min_interval=60)
    assert tr.maybe_write(min_interval=0)
    # close writes a last time; later events are ignored; closing again does nothing
    tr.span("run 2", "run", now + 4000, now + 5000)
    assert tr.close()
    tr.span("after close", "run", now, now)
    assert not tr.close()
    names = [e["name"] for e in load(path)["traceEvents"] if e["ph"] == "X"]
    assert names == ["run 0", "run 1", "run 2"]


def test_event_cap_counts_drops(tmp_path: Path) -> None:
    tr = Tracer(tmp_path / "t.json", max_events=10)
    for i in range(15):
        tr.instant(f"e{i}")
    data = load(tr.write())
    check_trace(data)
    assert sum(e["ph"] == "i" for e in data["traceEvents"]) == 10
    assert data["otherData"]["dropped_events"] == 5


def test_gpu_spans_at_once(tmp_path: Path) -> None:
    """A submission's GPU spans in one call land as single spans would: on their queues' tracks,
    in order, clamped, within the event cap (the excess counted), nothing once closed."""
    tr = Tracer(tmp_path / "t.json", max_events=4)
    tr.gpu_span("first", 0, 10)
    tr.gpu_spans([("stage", 100, 400, {"stage": "stage"}, GPU_QUEUE),
                  ("add", 110, 150, {"workgroups": 1}, GPU_DISPATCHES),
                  ("gelu", 160, 150, {"workgroups": 2, "replayed": True}, GPU_DISPATCHES),
                  ("over", 500, 600, None, GPU_QUEUE)])
    tr.close()
    tr.gpu_spans([("late", 700, 800, None, GPU_QUEUE)])
    data = load(tr.write())
    names = check_trace(data)
    spans = [(e["name"], names[e["tid"]], e["ts"], e["dur"], e.get("args")) for e in data["traceEvents"]
             if e["ph"] == "X"]
    origin = data["otherData"]["origin_perf_counter_ns"]
    us = lambda ns: (ns - origin) / 1e3  # noqa: E731
    assert [(n, track) for n, track, *_ in spans] == [("first", GPU_QUEUE), ("stage", GPU_QUEUE),
                                                     ("add", GPU_DISPATCHES), ("gelu", GPU_DISPATCHES)]
    assert spans[1][2:] == (pytest.approx(us(100)), pytest.approx(0.3), {"stage": "stage"})
    assert spans[3][3] == 0 and spans[3][4] == {"workgroups": 2, "replayed": True}  # an end before the start
    assert data["otherData"]["dropped_events"] == 1


def test_unwritable_path(tmp_path: Path) -> None:
    tr = Tracer(tmp_path / "missing-dir" / "t.json")
    tr.instant("x")
    with pytest.raises(OSError):
        tr.write()
    assert not tr.maybe_write(min_interval=0)  # logged and counted, not raised
    assert not tr.close()


def test_gpu_idle_causes_charges_each_gap_to_the_next_stages_run() -> None:
    """bench's idle attribution: a gap before a stage is split at its run's start, CPU stages'
    end, recording start and end; overlapping GPU spans are not counted twice."""
    from bench._common import gpu_idle_causes

    def meta(tid: int, name: str) -> dict:
        return {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}

    def span(tid: int, cat: str, name: str, ts: float, dur: float, **args) -> dict:
        return {"ph": "X", "pid": 1, "tid": tid, "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [meta(1, "event loop"), meta(2, "hetero-cpu-0"), meta(3, "hetero-gpu-0"), meta(9, "GPU queue"),
              {"ph": "i", "pid": 1, "tid": 1, "cat": "run", "name": "run 0 of 'g' starts", "ts": 0.0, "s": "t"},
              {"ph": "i", "pid": 1, "tid": 1, "cat": "run", "name": "run 1 of 'g' starts", "ts": 3000.0, "s": "t"},
              span(2, "cpu", "prep", 0.0, 500.0, run=0), span(3, "gpu-record", "s", 500.0, 500.0, run=0),
              span(9, "gpu", "s", 1000.0, 1000.0, stage="s", run=0),
              span(3, "submit", "submit #1", 1000.0, 0.0),
              # run 1 starts 1 ms after the GPU went idle, then 1 ms of CPU, 0.5 ms waiting, 1 ms recording,
              # 0.1 ms before its submission, 0.1 ms submitting and 0.05 ms before its GPU span
              span(2, "cpu", "prep", 3000.0, 1000.0, run=1), span(3, "gpu-record", "s", 4500.0, 1000.0, run=1),
              span(3, "submit", "submit #2", 5600.0, 100.0),
              span(9, "gpu", "s", 5750.0, 1000.0, stage="s", run=1),
              span(9, "gpu", "s2", 6000.0, 500.0, stage="s2", run=1)]  # inside the one before: no gap
    causes = gpu_idle_causes({"traceEvents": events}, 0.0, 7000.0)
    # the first gap is the window's first millisecond: run 0's CPU stage, then its recording
    assert causes == {"gaps": 2, "busy_ms": 2.0, "run not started": 1.0, "CPU stages": 1.5,
                      "waiting to be recorded": 0.5, "recording": 1.5, "waiting to be submitted": 0.1,
                      "submitting": 0.1, "submitted, not yet running": 0.05}


def test_lone_timeline_takes_the_median_of_each_mark_per_call() -> None:
    """bench's one-call timeline: marks in µs from each call's start (perf_counter_ns against the
    trace's origin), medians over the calls matched to exactly one run, in order."""
    from bench._common import lone_timeline

    origin = 1_000_000_000

    def meta(tid: int, name: str) -> dict:
        return {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}

    def span(tid: int, cat: str, name: str, ts: float, dur: float, **args) -> dict:
        return {"ph": "X", "pid": 1, "tid": tid, "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [meta(1, "event loop"), meta(3, "hetero-gpu-0"), meta(9, "GPU queue")]
    calls = []
    for run, (base, slow) in enumerate([(0.0, 0.0), (10_000.0, 100.0), (20_000.0, 200.0)]):
        events += [{"ph": "i", "pid": 1, "tid": 1, "cat": "run", "name": f"run {run} of 'g' starts",
                    "ts": base + 50, "s": "t"},
                   span(1, "cpu", "tokenize", base + 60, 40 + slow, run=run),
                   span(3, "gpu-record", "s", base + 200, 300, run=run),
                   span(3, "submit", f"submit #{run}", base + 520, 80),
                   span(9, "gpu", "s", base + 650, 200, stage="s", run=run),
                   span(5, "transfer", "download", base + 900, 50, bytes=4)]
        calls.append((origin + int(base * 1e3), origin + int((base + 1000 + slow) * 1e3)))
    calls.append((origin + int(40_000e3), origin + int(41_000e3)))  # no run inside: not matched
    got = lone_timeline({"traceEvents": events, "otherData": {"origin_perf_counter_ns": origin}}, calls)
    assert got == {"calls": 3, "run starts": 50.0, "tokenize done": 200.0, "s recording starts": 200.0,
                   "s recorded": 500.0, "s submitted": 600.0, "s on the GPU from": 650.0,
                   "s on the GPU until": 850.0, "downloaded": 950.0, "call returns": 1100.0}
    assert list(got)[1:] == sorted(list(got)[1:], key=lambda k: got[k])


def test_dispatches_between_counts_each_span_in_start_order() -> None:
    from bench._common import dispatches_between

    def span(name: str, ts: float, tid: int = 2) -> dict:
        return {"ph": "X", "tid": tid, "ts": ts, "dur": 1.0, "name": name}
    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "tid": 2, "args": {"name": "GPU dispatches"}},
        {"ph": "M", "name": "thread_name", "tid": 3, "args": {"name": "GPU queue"}},
        span("embed", 0), span("a", 2), span("b", 1), span("gather", 3), span("head", 4),  # out of order: by ts
        span("a", 4.5, tid=3),  # another track: not counted
        span("embed", 5), span("a", 6), span("gather", 7), span("a", 8)]}
    assert dispatches_between(trace, "embed", "gather") == [2, 1]
    assert dispatches_between(trace, "embed", "nothing") == []
