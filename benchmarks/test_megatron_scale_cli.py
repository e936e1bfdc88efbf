"""The command line of ``python -m benchmarks.megatron_scale``: bad input is refused before any
child starts, naming what is allowed; the table keys each figure by its expert-parallel ranks."""

from __future__ import annotations

import pytest

from benchmarks import megatron_scale as ms

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("ep", ["0", "3", "16"])
def test_ep_must_split_the_eight_experts(ep):
    with pytest.raises(SystemExit, match=r"--ep .*allowed 1, 2, 4, 8"):
        ms.main(["--device", "cpu", "--models", "moe", "--ep", ep])


def test_ep_needs_moe_models_only():
    with pytest.raises(SystemExit, match="needs MoE models only: --models moe,moe-kept-probs"):
        ms.main(["--device", "cpu", "--models", "moe,gpt-mtp", "--ep", "2"])
    with pytest.raises(SystemExit, match="needs MoE models only"):
        ms.main(["--child", "gpt-mtp", "ours", "--device", "cpu", "--ep", "2"])


def test_ep_on_cuda_needs_a_gpu_per_rank():
    import torch

    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has 8 GPUs: --ep 8 would run")
    with pytest.raises(SystemExit, match=r"--ep 8 on cuda needs 8 GPUs \(one rank each\)"):
        ms.main(["--device", "cuda", "--models", "moe", "--ep", "8"])


def test_table_compares_each_strategy_with_none_of_the_same_expert_parallel_degree():
    base = dict(model="moe", dispatcher="allgather", hidden=256, seq=256, dtype="fp32",
                requested_peak_bytes=0, retained_bytes=0, step_ms=1.0, step_time_ratio=1.0)
    cells = [dict(base, strategy="none", expert_parallel=2, peak_bytes=80 * ms.MIB),
             dict(base, strategy="none", expert_parallel=1, peak_bytes=100 * ms.MIB),
             dict(base, strategy="ours", expert_parallel=2, peak_bytes=60 * ms.MIB)]
    (ours,) = [ln for ln in ms.table(cells).splitlines() if " ours " in ln]
    assert " 2 256x256" in ours and "0.7500" in ours  # 60 / 80, not 60 / 100


@pytest.mark.parametrize(("device", "ep", "forked"), [
    ("cpu", 1, True), ("cpu", 2, True), ("cuda", 1, True), ("cuda", 2, False)])
def test_children_are_forked_by_the_fork_server_but_cuda_ranks(monkeypatch, device, ep, forked):
    """A child (each rank of a CPU one) is forked from the fork server, torch and megatron-core
    imported there once (the server never touches CUDA: a CUDA child initialises it itself);
    the ranks of a two-rank CUDA child are fresh interpreters."""
    from repro.harness import isolated
    from repro.harness.isolated_result import IsolatedResult

    calls = []
    done = IsolatedResult(returncode=0, stdout='CELLS [{"hidden": 256}]\n', stderr="",
                          seconds=0.0, timed_out=False)

    def fake_isolated(**kwargs):
        calls.append(("isolated", kwargs.get("forkserver", False)))
        return done

    def fake_ranks(argv, world_size, **kwargs):
        calls.append(("ranks", kwargs.get("forkserver", False)))
        return [done] * world_size

    monkeypatch.setattr(isolated, "run_isolated", fake_isolated)
    monkeypatch.setattr(isolated, "run_loopback_ranks", fake_ranks)
    assert ms.cells_in_child("moe", "ours", device, [(256, 256)], ["fp32"], 5, ep=ep) == [
        {"hidden": 256}]
    assert calls == [("isolated" if ep == 1 else "ranks", forked)]
