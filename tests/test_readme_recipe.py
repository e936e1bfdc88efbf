"""README.md's recipe for a user's own regression test is run as one: the code block between
its ``recipe`` markers, as a test file of an inner pytest that finds stackfix's pytest plugin as
a user's does, under ``--strict-markers``. A README whose example no longer passes fails here."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu
pytest_plugins = ("pytester",)
README = Path(__file__).parent.parent / "README.md"
PLUGIN = "fixes.testing.pytest_plugin"


def recipe() -> str:
    text = README.read_text()
    block = re.search(r"<!-- recipe:begin[^>]*-->\s*```python\n(.*?)```\s*<!-- recipe:end -->",
                      text, re.S)
    assert block, "README.md has no recipe block between <!-- recipe:begin --> and :end"
    return block[1]


def test_the_readmes_recipe_passes_as_a_users_test_file(pytester):
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    pytester.makepyfile(test_recipe=recipe())
    installed = any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))
    args = [] if installed else ["-p", PLUGIN]
    result = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider", "-q",
                                           "--strict-markers")
    result.assert_outcomes(passed=2)
