"""Suite-wide rules: every test carries exactly one of the ``cpu`` / ``gpu`` markers, and
``gpu`` tests skip (with the reason) where CUDA is absent instead of erroring."""

from __future__ import annotations

import pytest

DEVICE_MARKERS = ("cpu", "gpu")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    bad = []
    for item in items:
        marks = {m.name for m in item.iter_markers() if m.name in DEVICE_MARKERS}
        if len(marks) != 1:
            bad.append(f"{item.nodeid}: {sorted(marks) or 'no device marker'}")
    if bad:
        raise pytest.UsageError(
            "every test must carry exactly one of the markers cpu / gpu:\n  " + "\n  ".join(bad)
        )
    if not _cuda_available():
        skip = pytest.mark.skip(reason="CUDA not available (torch.cuda.is_available() is False)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
