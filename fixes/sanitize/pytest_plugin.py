"""pytest plugin: ``pytest --stackfix-sanitize`` runs every test under ``storage_sanitizer()``
and, where spmd_types imports, ``mesh_sanitizer()``. Off unless the flag is given.
``--stackfix-sanitize=storage,mesh,recompute`` names the sanitizers (any of ``SANITIZERS``;
``recompute`` is ``recompute_sanitizer()``, ``recompute:sampled`` / ``recompute:none`` its
cheaper values modes); the bare flag is ``storage,mesh``.

Registered through the ``pytest11`` entry point of the stackfix distribution (so any suite in an
environment with stackfix installed has the flag); without installing, load it with
``-p fixes.sanitize.pytest_plugin``. A test's setup, call, teardown and report run sanitized, in
the test's own process: child processes a test starts are not. A test marked
``no_stackfix_sanitize`` (one that enters the sanitizers itself) is left alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import pytest

from fixes.sanitize._modes import VALUES as RECOMPUTE_MODES  # recompute_sanitizer(values=...)

OPTION = "--stackfix-sanitize"
SANITIZERS = ("storage", "mesh", "recompute")
DEFAULT = ("storage", "mesh")
# For tests that enter the sanitizers themselves (they refuse to be nested): left unwrapped.
MARKER = "no_stackfix_sanitize"
MARKER_HELP = (f"{MARKER}: the test enters fixes.sanitize's sanitizers itself, so "
               f"{OPTION} does not wrap it")
_MESH_KEY = pytest.StashKey[str | None]()  # None: mesh sanitizer on; else why it is off
_RECOMPUTE_KEY = pytest.StashKey[object]()  # the recompute_sanitizer entered around the test


def _sanitizers(value: str | None) -> dict[str, str | None]:
    """name -> mode (recompute's values mode, or None) of each sanitizer ``value`` names."""
    if value is None:
        return {}
    not_a_list = pytest.UsageError(
        f"{OPTION}={value}: {value!r} is not a comma-separated list of {', '.join(SANITIZERS)} "
        f"(recompute:MODE: one of {', '.join(RECOMPUTE_MODES)})")
    chosen: dict[str, str | None] = {}
    for item in filter(None, (n.strip() for n in value.split(","))):
        name, _, mode = item.partition(":")
        if name not in SANITIZERS:
            raise not_a_list
        if mode and name != "recompute":
            raise pytest.UsageError(f"{OPTION}={value}: {item!r}: only recompute takes a mode")
        if name == "recompute" and mode not in ("", *RECOMPUTE_MODES):
            raise pytest.UsageError(f"{OPTION}={value}: {item!r}: recompute's mode must be one "
                                    f"of {', '.join(RECOMPUTE_MODES)}")
        chosen[name] = mode or ("all" if name == "recompute" else None)
    if not chosen:
        raise not_a_list
    return chosen


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("stackfix").addoption(
        OPTION, nargs="?", const=",".join(DEFAULT), default=None,
        metavar="storage,mesh,recompute[:all|sampled|none]",
        help="run each test under fixes.sanitize's sanitizers: storage (a read of memory that "
        "UntypedStorage.resize_ released raises ReleasedStorageError), mesh, where spmd_types "
        "imports (no spmd mesh in checkpoint recompute raises MeshLostError), recompute (a "
        "checkpoint recompute that computes what backward uses differently from its forward "
        "raises RecomputeMismatchError; recompute:sampled fingerprints every 8th region of a "
        "call site, recompute:none compares metadata and the state regions reach only). "
        "Without a value: storage,mesh",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args: list[str]) -> None:
    # The value is optional, so argparse would take a test path after the bare flag for its
    # value (``pytest --stackfix-sanitize tests/``); the bare flag is spelled out before the
    # command line is parsed for good (pytest parses this same list). The value is checked in
    # pytest_configure: an early parse may still have taken the path.
    args[:] = [f"{OPTION}={','.join(DEFAULT)}" if a == OPTION else a for a in args]


def _enabled(config: pytest.Config) -> dict[str, str | None]:
    return _sanitizers(config.getoption(OPTION))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    if "mesh" not in _enabled(config):
        return
    try:
        import spmd_types  # noqa: F401
    except ImportError as exc:  # absent or not importable here: the mesh part is off
        config.stash[_MESH_KEY] = f"spmd_types does not import: {type(exc).__name__}: {exc}"
    else:
        config.stash[_MESH_KEY] = None


def pytest_report_header(config: pytest.Config) -> str | None:
    names = _enabled(config)
    if not names:
        return None
    parts = []
    for name in SANITIZERS:
        if name not in names:
            continue
        why_not = config.stash[_MESH_KEY] if name == "mesh" else None
        mode = names[name] if names[name] not in (None, "all") else None
        parts.append(f"{name}_sanitizer" + (f" off ({why_not})" if why_not else "")
                     + (f" (values={mode})" if mode else ""))
    return f"stackfix sanitizers: {', '.join(parts)}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # Around the whole protocol, not just the call: the failure report is written in here too,
    # and a repr of a released tensor in it (pytest shows frame arguments) must not read freed
    # memory.
    names = _enabled(item.config)
    if not names or item.get_closest_marker(MARKER):
        return (yield)
    import fixes.sanitize as sanitize
    from fixes.sanitize._callsite import entered_as

    with contextlib.ExitStack() as stack:
        with entered_as(f"by the pytest plugin {__name__} ({OPTION}) around {item.nodeid}",
                        f"mark the test @pytest.mark.{MARKER} to enter the sanitizers itself",
                        joinable=True):
            for name in SANITIZERS:
                if name in names and (name != "mesh" or item.config.stash[_MESH_KEY] is None):
                    kwargs = {"values": names[name]} if name == "recompute" else {}
                    entered = stack.enter_context(getattr(sanitize, f"{name}_sanitizer")(**kwargs))
                    if name == "recompute":
                        item.stash[_RECOMPUTE_KEY] = entered
        try:
            return (yield)
        finally:
            item.stash[_RECOMPUTE_KEY] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    # A detection of the test's last step is raised on the sanitizer's exit, which is after
    # the report here: raised at the end of the call instead, as the test's failure.
    result = yield
    sanitizer = item.stash.get(_RECOMPUTE_KEY, None)
    if sanitizer is not None:
        sanitizer.raise_pending()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A ReleasedStorageError failure (with or without the flag) is shown from the user's
    side: torch's and the sanitizer's frames are left out of its traceback (the deepest frame
    shown is the op's caller), and the short summary line is the error's ``summary`` (op,
    caller, release site) rather than the start of its qualified name."""
    released = _released_storage_error()
    excinfo = call.excinfo
    ours = released is not None and excinfo is not None and excinfo.errisinstance(released)
    if ours:
        _drop_hidden_frames(excinfo)
    report = yield
    crash = getattr(report.longrepr, "reprcrash", None)
    if ours and crash is not None:
        crash.message = excinfo.value.summary
    return report


def _drop_hidden_frames(excinfo: pytest.ExceptionInfo) -> None:
    # Relinks the raw traceback: pytest's traceback filter re-walks it from the test's own
    # entry (Traceback.cut), so filtering pytest's Traceback object alone would not hold.
    kept = []
    tb = excinfo.tb
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_HIDDEN):
            kept.append(tb)
        tb = tb.tb_next
    if not kept or kept[0] is not excinfo.tb:
        return
    for tb, after in zip(kept, [*kept[1:], None], strict=True):
        tb.tb_next = after
    excinfo.traceback = type(excinfo.traceback)(excinfo.tb)


def _released_storage_error():
    # Looked up, not imported: a session that never imported the sanitizer (and so torch)
    # cannot have raised it, and this plugin loads in every session of the environment.
    module = sys.modules.get("fixes.sanitize._released")
    return getattr(module, "ReleasedStorageError", None)


def _hidden_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        dirs.append(os.path.dirname(os.path.abspath(spec.origin)) + os.sep)
    return tuple(dirs)


_HIDDEN = _hidden_dirs()  # torch's package and fixes.sanitize's
