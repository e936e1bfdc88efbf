"""The reclaim changes no gradient of a real megatron-core model: one full-recompute step with
it and without it give bitwise the same gradients (tests/megatron_grad_parity.py builds the
models), on the installed megatron-core release and on a Megatron-LM dev checkout
(``STACKFIX_MEGATRON_LM``), each in a child interpreter. The child also says how many
checkpoint inputs the reclaim examined after a recompute: a step that checkpointed nothing would
compare nothing."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from repro import run_isolated
from repro.harness.megatron_lm import ENV_VAR, megatron_lm_checkout, skip_reason

pytestmark = pytest.mark.cpu
REPO = Path(__file__).parent.parent
DTYPES = ["fp32", "bf16"]


def _parity(model: str, dtype: str, dev: bool) -> str:
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    setup = ""
    env = {}
    if dev:
        why = skip_reason()
        if why is not None:
            pytest.skip(why)
        setup = ("from repro.mtp_shape_megatron_dev import setup_dev_megatron\n"
                 "setup_dev_megatron('cpu')\n")
        env = {ENV_VAR: str(megatron_lm_checkout())}
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {str(REPO / "tests")!r})
    """) + setup + textwrap.dedent(f"""
        import megatron_grad_parity
        print("PARITY", megatron_grad_parity.parity({model!r}, {dtype!r}))
    """)
    # spawned, not forked: a dev checkout must be first on sys.path before megatron is imported
    r = run_isolated(code=code, timeout=300, cwd=str(REPO), env=env, forkserver=not dev)
    assert r.ok, r.describe() + "\n" + r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("PARITY ")]
    return line[len("PARITY "):]


def _assert_bitwise(verdict: str) -> None:
    match = re.fullmatch(r"bitwise \((\d+) grads, (\d+) inputs examined\)", verdict)
    assert match, verdict
    assert int(match[1]) > 0 and int(match[2]) > 0, verdict


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", ["gpt-mtp", "moe-aux"])
def test_installed_megatron_gradients_are_bitwise_unchanged(model, dtype):
    _assert_bitwise(_parity(model, dtype, dev=False))


@pytest.mark.parametrize("model", ["gpt-mtp", "moe-aux", "mhc-mtp"])
def test_megatron_lm_dev_gradients_are_bitwise_unchanged(model):
    _assert_bitwise(_parity(model, "fp32", dev=True))
