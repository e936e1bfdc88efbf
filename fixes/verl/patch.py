"""One plugin patch: what it changes, in which verl module, on which releases."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

logger = logging.getLogger("fixes.verl")


@dataclass(frozen=True, kw_only=True, slots=True)
class VerlPatch:
    name: str  # what it changes, as the log line says it
    module: str  # the verl module it patches, right after that module is imported
    # verl release -> None (patch it) or why it is left alone there (e.g. verl has the fix)
    releases: Mapping[str, str | None]
    install: Callable[[ModuleType, str], None]  # (the module, the verl version)

    def left_alone(self, version: str) -> str | None:
        """Why this patch does nothing on verl ``version`` (None: it applies)."""
        if version not in self.releases:
            return "not a release this plugin was tested on"
        return self.releases[version]


def left_alone_at_install(patch: str, version: str, why: str) -> None:
    """The one line for a patch that found, once its module was imported, nothing to patch."""
    logger.warning("stackfix verl plugin: verl %s: left %s alone: %s", version, patch, why)
