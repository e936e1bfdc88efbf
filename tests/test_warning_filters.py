"""The pytest config's warning filters (pyproject.toml ``filterwarnings``) hide the known
third-party warnings, as their code emits them, and nothing of ours. A child pytest run under
that config emits each known warning (its text, category and the module it is attributed to,
read in megatron-core 0.16.1 / torch 2.13) and one of ours; its summary must show ours alone.
A filter no known warning needs fails too: a stale filter hides warnings nobody reviewed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parent.parent
FILTERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
    "filterwarnings"]

# (message, category, module the warning is attributed to)
KNOWN = [
    # megatron/core/utils.py, stacklevel=2: attributed to whoever built the layer
    ("Warning: tp_group is None, using default tp group. Passing tp_group will be mandatory soon",
     "DeprecationWarning", "tests.test_mtp_postprocess"),
    ("Apex is not installed. Falling back to Torch Norm", "UserWarning",
     "megatron.core.models.gpt.gpt_layer_specs"),
    ("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
     "UserWarning", "megatron.core.transformer.transformer_config"),
    ("MLP requires ffn_hidden_size, but it was not provided. Using config.ffn_hidden_size by "
     "default.", "DeprecationWarning", "megatron.core.transformer.spec_utils"),
    ("The 'megatron.core.transformer.custom_layers.transformer_engine' module is deprecated",
     "DeprecationWarning", "megatron.core.transformer.multi_latent_attention"),
    # torch/jit/_script.py: attributed to the module defining the script method
    ("`torch.jit.script_method` is deprecated. Please switch to `torch.compile` or "
     "`torch.export`.", "DeprecationWarning", "megatron.core.fusions.fused_bias_gelu"),
]
OURS = ("stackfix: ours", "RuntimeWarning", "fixes.megatron.reclaim")


def _matches(entry: str, message: str, category: str, module: str) -> bool:
    """As pytest reads an ini filter: message and module are regexes matched at the start."""
    _, msg, cat, mod, *_ = [*entry.split(":"), "", "", ""]
    return (re.match(msg, message, re.I) is not None and (not cat or cat == category)
            and re.match(mod, module) is not None)


def test_every_filter_is_needed_by_a_known_warning():
    stale = [f for f in FILTERS if not any(_matches(f, *w) for w in KNOWN)]
    assert not stale, f"filters no known warning needs (add the warning to KNOWN, or drop): {stale}"


def test_the_known_third_party_warnings_are_hidden_and_ours_stay_visible(tmp_path):
    calls = "".join(f"    warnings.warn_explicit({m!r}, {c}, 'x.py', 1, module={mod!r})\n"
                    for m, c, mod in [*KNOWN, OURS])
    (tmp_path / "test_emits.py").write_text(
        textwrap.dedent("import warnings\n\n\ndef test_emits():\n") + calls)
    r = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
                        "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-p", "no:xdist",
                        str(tmp_path / "test_emits.py")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 passed, 1 warning" in r.stdout, r.stdout[-3000:]
    assert "stackfix: ours" in r.stdout
