"""``python -m repro``'s cheap answers import no repro module (so no torch, no spmd_types), and
a repro skipped by its precondition starts no child; repro/catalog.json is what they read and
must equal what the REPROS lists declare. Each check runs the CLI in a fresh interpreter and
reads its ``sys.modules`` there (what the parent test process imported says nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from repro import catalog

pytestmark = pytest.mark.cpu

HEAVY = ("torch", "spmd_types", "megatron", "torchtitan")

# Runs main(argv) in the child, with run_isolated replaced so that starting a child is an error,
# and prints the exit status, the heavy modules imported and the stdout main printed.
_PROBE = f"""
import contextlib, io, json, sys
import repro.runner
def _no_child(*a, **k):
    raise AssertionError("a child was started")
repro.runner.run_isolated = _no_child
from repro.__main__ import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        rc = main(json.loads(sys.argv[1]))
    except SystemExit as e:
        rc = e.code
heavy = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps({{"rc": rc, "heavy": heavy, "out": out.getvalue(), "err": err.getvalue()}}))
"""


def _cli(*argv: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "STACKFIX_MEGATRON_LM"} | env
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(argv))],
                          capture_output=True, text=True, env=environ, timeout=120, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv, rc", [
    (["--help"], 0), (["--list"], 0), (["--only", "nosuch"], 2), (["--device", "tpu"], 2),
    (["--only", "mesh-recompute", "--json", "/nonexistent/x.json"], 2),
])
def test_cheap_answers_import_no_repro_module(argv, rc):
    r = _cli(*argv)
    assert (r["rc"], r["heavy"]) == (rc, [])


# Each bad input is answered before any child starts, naming what is allowed.
_NOT_ON_OFF = "is not an on/off value: on is 1, true, yes or on; off is 0, false, no or off"


@pytest.mark.parametrize("argv, env, says", [
    (["-j", "abc"], {}, "argument -j/--jobs: 'abc' is not a whole number (N >= 1)"),
    (["-j", "0"], {}, "argument -j/--jobs: must be >= 1, got 0"),
    (["--only", "mesh-recompute", "--json", ""], {}, "error: --json '': an empty path"),
    (["--only", "mesh-recompute"], {"STACKFIX_FORKSERVER": "maybe"},
     f"error: STACKFIX_FORKSERVER='maybe' {_NOT_ON_OFF}"),
    (["--only", "mesh-recompute"], {"STACKFIX_SANITIZE": "bogus"},
     "error: STACKFIX_SANITIZE='bogus': unknown sanitizer(s) ['bogus']; allowed: a "
     "comma-separated list of storage, mesh, recompute, or on (storage,mesh) / off: on is 1"),
    (["--only", "mtp-shape-megatron-dev"], {"STACKFIX_MEGATRON_LM": "/tmp"},
     "error: STACKFIX_MEGATRON_LM=/tmp: no megatron/core/transformer/multi_token_prediction.py "
     "there; it must name a Megatron-LM checkout (pinned: Megatron-LM dev at d48bd6be"),
])
def test_bad_input_is_an_error_at_once_naming_what_is_allowed(argv, env, says):
    r = _cli(*argv, **env)
    assert (r["rc"], r["heavy"]) == (2, []), r
    assert says in r["err"], r["err"]


def test_list_shows_only_the_repros_named():
    r = _cli("--list", "--only", "mtp-shape", "--only", "mesh-recompute")
    assert r["rc"] == 0 and [line.split()[0] for line in r["out"].splitlines()] == [
        "mtp-shape", "mesh-recompute"]
    unknown = _cli("--list", "--only", "nosuch")
    assert unknown["rc"] == 2 and "unknown repro 'nosuch'" in unknown["err"]


def test_list_names_every_repro_from_the_catalog():
    r = _cli("--list")
    listed = [line.split()[0] for line in r["out"].splitlines()]
    assert listed == list(catalog.load())


@pytest.mark.parametrize("name", ["mtp-shape-megatron-dev", "mtp-shape-megatron-dev-verl080"])
def test_unmet_precondition_skips_in_the_parent_without_a_child(name):
    r = _cli("--only", name)
    assert r["rc"] == 3 and r["heavy"] == []  # skipped (asked for by name); nothing imported
    row = next(line for line in r["out"].splitlines() if line.startswith(name))
    assert row.split()[1:5] == ["cpu", "skipped", "skipped", "0.0"]
    assert "STACKFIX_MEGATRON_LM is not set" in r["out"]


def test_catalog_equals_the_declared_repros():
    # discover() imports every repro module: in a child, so this process keeps its imports.
    proc = subprocess.run([sys.executable, "-m", "repro.catalog", "--check"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_catalog_entry_judges_like_its_repro():
    from repro.registry import discover
    from repro.runner import skip_reason

    repros = discover()
    for name, e in catalog.load().items():
        for device in ("cpu", "cuda"):
            assert skip_reason(e, device) == skip_reason(repros[name], device), (name, device)


def test_a_python_without_the_projects_dependencies_is_told_how_to_get_them():
    # Run from a Python without them (a newcomer's `python3 -m repro` outside tox), it raised
    # ModuleNotFoundError: spmd_types from the first repro module it imported. Here spmd_types
    # is hidden from the child by a finder that refuses it.
    hide = ("import sys, importlib.abc\n"
            "class _Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'spmd_types':\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, _Hide())\n")
    proc = subprocess.run([sys.executable, "-c", hide + _PROBE,
                           json.dumps(["--only", "mesh-recompute"])],
                          capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["rc"] == 2, r
    assert "spmd_types" in r["err"] and "tox -e repro" in r["err"], r["err"]
    assert "torch" not in r["heavy"] and "spmd_types" not in r["heavy"]
