"""pytest plugin: ``pytest --stackfix-sanitize`` runs every test under ``storage_sanitizer()``
and, where spmd_types imports, ``mesh_sanitizer()``. Off unless the flag is given.

Registered through the ``pytest11`` entry point of the stackfix distribution (so any suite in an
environment with stackfix installed has the flag); without installing, load it with
``-p fixes.sanitize.pytest_plugin``. A test's setup, call, teardown and report run sanitized, in
the test's own process: child processes a test starts are not. A test marked
``no_stackfix_sanitize`` (one that enters the sanitizers itself) is left alone.
"""

from __future__ import annotations

import contextlib

import pytest

OPTION = "--stackfix-sanitize"
# For tests that enter the sanitizers themselves (they refuse to be nested): left unwrapped.
MARKER = "no_stackfix_sanitize"
MARKER_HELP = (f"{MARKER}: the test enters fixes.sanitize's sanitizers itself, so "
               f"{OPTION} does not wrap it")
_MESH_KEY = pytest.StashKey[str | None]()  # None: mesh sanitizer on; else why it is off


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("stackfix").addoption(
        OPTION, action="store_true", default=False,
        help="run each test under fixes.sanitize's storage_sanitizer() (a read of memory that "
        "UntypedStorage.resize_ released raises ReleasedStorageError) and, where spmd_types "
        "imports, mesh_sanitizer() (no spmd mesh in checkpoint recompute raises MeshLostError)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    if not config.getoption(OPTION):
        return
    try:
        import spmd_types  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure turns the mesh part off
        config.stash[_MESH_KEY] = f"spmd_types does not import: {type(exc).__name__}: {exc}"
    else:
        config.stash[_MESH_KEY] = None


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.getoption(OPTION):
        return None
    why_not = config.stash[_MESH_KEY]
    mesh = "mesh_sanitizer" if why_not is None else f"mesh_sanitizer off ({why_not})"
    return f"stackfix sanitizers: storage_sanitizer, {mesh}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # Around the whole protocol, not just the call: the failure report is written in here too,
    # and a repr of a released tensor in it (pytest shows frame arguments) must raise, not
    # read freed memory.
    if not item.config.getoption(OPTION) or item.get_closest_marker(MARKER):
        return (yield)
    from fixes.sanitize import mesh_sanitizer, storage_sanitizer

    with contextlib.ExitStack() as stack:
        stack.enter_context(storage_sanitizer())
        if item.config.stash[_MESH_KEY] is None:
            stack.enter_context(mesh_sanitizer())
        return (yield)
