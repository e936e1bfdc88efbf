"""Shared by the tests that run verl's released reclaim on megatron-core: the devices they run
on (CPU anywhere, CUDA in the gpu run) and the skip when a part is missing."""

from __future__ import annotations

import pytest

from repro.verl_release import missing_release

DEVICES = [pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("cuda", marks=pytest.mark.gpu)]


def need_verl_on_megatron(version: str) -> None:
    """Skip unless megatron-core imports and verl ``version``'s release is installed."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    why = missing_release(version)
    if why is not None:
        pytest.skip(why)
