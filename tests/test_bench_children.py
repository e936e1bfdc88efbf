"""The megatron-scale session's children (benchmarks._children): one child per strategy and
size with every selected model in it, run together only where the session shares the GPU."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from benchmarks import _children
from benchmarks import test_bench_megatron_scale as bench

pytestmark = pytest.mark.cpu


def _need(model, strategy, size=(2048, 4096), device="cuda", ep=1):
    return _children.Need(device, model, strategy, ep, *size)


def test_one_child_per_strategy_and_size_with_every_model_in_it():
    needs = [_need("moe", "ours"), _need("gpt-mtp", "ours"), _need("moe", "none"),
             _need("moe", "ours"), _need("moe", "ours", size=(1024, 2048)),
             _need("moe", "ours", ep=2)]
    assert _children.plan(needs) == {
        ("cuda", "ours", 1, 2048, 4096): ["moe", "gpt-mtp"],
        ("cuda", "none", 1, 2048, 4096): ["moe"],
        ("cuda", "ours", 1, 1024, 2048): ["moe"],
        ("cuda", "ours", 2, 2048, 4096): ["moe"]}


def _recording_measure(log, hold=0.05):
    lock, running = threading.Lock(), [0]

    def measure(key, models):
        with lock:
            running[0] += 1
            log.append(("start", key[1], tuple(models), running[0]))
        time.sleep(hold)
        with lock:
            running[0] -= 1
        return [{"model": m, "strategy": key[1], "hidden": key[3]} for m in models]

    return measure


@pytest.mark.parametrize("at_once", [1, 3])
def test_children_run_at_most_at_once_together_and_each_model_gets_its_cells(at_once):
    log: list = []
    needs = [_need(m, s) for s in ("none", "verl-0.8.0", "ours", "gc-collect")
             for m in ("moe", "gpt-mtp")]
    children = _children.Children(needs, _recording_measure(log), at_once)
    try:
        got = children.cells(_need("gpt-mtp", "ours"))
    finally:
        children.close()
    assert got == [{"model": "gpt-mtp", "strategy": "ours", "hidden": 2048}]
    starts = [e for e in log if e[0] == "start"]
    assert len(starts) == 4  # four strategies, both models in each child
    assert all(models == ("moe", "gpt-mtp") for _, _, models, _ in starts)
    assert max(together for *_, together in starts) == at_once


def test_a_cell_nobody_planned_is_measured_alone_and_a_dead_childs_error_reaches_each_model():
    log: list = []
    children = _children.Children([_need("moe", "ours")], _recording_measure(log), 1)
    try:
        assert children.cells(_need("gpt-mtp", "ours")) == [
            {"model": "gpt-mtp", "strategy": "ours", "hidden": 2048}]
    finally:
        children.close()
    assert ("start", "ours", ("gpt-mtp",), 1) in log

    died = [{"model": "moe,gpt-mtp", "strategy": "none", "error": "exit -9"}]
    children = _children.Children([_need("moe", "none"), _need("gpt-mtp", "none")],
                                  lambda key, models: died, 1)
    try:
        assert children.cells(_need("gpt-mtp", "none")) == died
    finally:
        children.close()


def test_children_run_together_only_on_cuda_where_the_session_shares_the_gpu(monkeypatch):
    monkeypatch.delenv(bench.SHARED_GPU, raising=False)
    assert _children.at_once(bench.SHARED_GPU, "cuda") == 1
    monkeypatch.setenv(bench.SHARED_GPU, "11")
    assert _children.at_once(bench.SHARED_GPU, "cuda") == _children.AT_ONCE > 1
    assert _children.at_once(bench.SHARED_GPU, "cpu") == 1


def _item(name, **params):
    return SimpleNamespace(module=bench, originalname=name, callspec=SimpleNamespace(params=params))


def test_a_sessions_needs_are_its_tests_strategies_and_what_each_relation_reads(monkeypatch):
    monkeypatch.setattr(bench, "_unrunnable", lambda device, model, strategy: None)
    cell = dict(device="cuda", hidden=2048, seq=4096, dtype="fp32")
    items = [_item("test_ours_frees_what_verl_080_frees", model="moe", strategy="ours", **cell),
             _item("test_ours_step_time_within_one_percent", model="gpt-mtp", strategy="ours",
                   **cell),
             _item("test_cpu_only_thing", **cell),  # no strategy: not a cell
             SimpleNamespace(module=None, originalname="x")]
    monkeypatch.delenv(bench.SHARED_GPU, raising=False)
    assert _children.plan(bench._needs(items)["cuda"]) == {
        ("cuda", "ours", 1, 2048, 4096): ["moe", "gpt-mtp"],
        ("cuda", "verl-0.8.0", 1, 2048, 4096): ["moe"]}
    # beside other sessions the step-time gate skips: its cell is not needed for it
    monkeypatch.setenv(bench.SHARED_GPU, "11")
    assert _children.plan(bench._needs(items)["cuda"]) == {
        ("cuda", "ours", 1, 2048, 4096): ["moe"],
        ("cuda", "verl-0.8.0", 1, 2048, 4096): ["moe"]}


def test_every_strategy_a_relation_test_reads_is_declared_in_reads():
    """READS must name what each relation test's body asks for (else it is measured late, in a
    child of its own): the names it passes to megatron_cells as a literal."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(bench))
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
        literal = {call.args[-1].value for call in ast.walk(fn)
                   if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "megatron_cells"
                   and isinstance(call.args[-1], ast.Constant)}
        assert literal == set(bench.READS.get(fn.name, ())), fn.name


def test_a_child_out_of_device_memory_beside_others_runs_once_more_and_alone_never_again(capfd):
    calls: list = []

    def measure(key, models):
        calls.append(key)
        if len(calls) == 1:
            return [{"model": "moe,gpt-mtp", "error": "OutOfMemoryError: CUDA out of memory"}]
        return [{"model": m, "hidden": key[3]} for m in models]

    shared = _children.Children([_need("moe", "ours")], measure, at_once=2)
    try:
        assert shared.cells(_need("moe", "ours")) == [{"model": "moe", "hidden": 2048}]
    finally:
        shared.close()
    assert shared.retried == [("cuda", "ours", 1, 2048, 4096)] and len(calls) == 2
    # the session's log says so (the step log of ci/gpu_run.py, whatever pytest captures)
    assert "('cuda', 'ours', 1, 2048, 4096) ran out of device memory" in capfd.readouterr().err

    calls.clear()
    alone = _children.Children([_need("moe", "ours")], measure, at_once=1)
    try:  # one at a time: an OOM is the child's own
        assert "OutOfMemoryError" in alone.cells(_need("moe", "ours"))[0]["error"]
    finally:
        alone.close()
    assert alone.retried == [] and len(calls) == 1
