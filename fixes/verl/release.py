"""Which verl release this process runs, and which releases the plugin knows.

A patch is applied only on a release it was written and tested against (``KNOWN``): verl's
internals (the reclaim's home, the engine's init order, the MTP postprocess copy) move between
releases, and a patch applied to code it was not written for would look like a fix without
being one.
"""

from __future__ import annotations

import importlib.metadata
import sys

KNOWN = ("0.8.0", "0.9.1")


def verl_version() -> str | None:
    """The version of the verl being imported (``verl.__version__``: set by verl's ``__init__``
    before it loads plugins), else of the installed distribution; None without verl."""
    module = sys.modules.get("verl")
    version = getattr(module, "__version__", None)
    if isinstance(version, str) and version:
        return version
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None
