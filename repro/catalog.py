"""What ``python -m repro`` knows about every repro before importing one: ``repro/catalog.json``.

The repro modules import torch, spmd_types and friends at the top (2-4 s, more on a loaded
machine), so the runner's cheap work -- ``--help``, ``--list``, an unknown ``--only`` name, a
repro that is skipped before it starts (no variant for the device, a missing package, an unmet
precondition such as ``STACKFIX_MEGATRON_LM`` unset) -- reads this file instead and imports only
the module that declares a repro it runs. The file is generated from the ``REPROS`` lists, never
edited by hand::

    python -m repro.catalog          # rewrite repro/catalog.json from discover()
    python -m repro.catalog --check  # exit 1 when it differs (tests/test_cli_imports.py runs this)

A repro module added without regenerating is noticed (its module is not in the file) and the
runner falls back to ``discover()``, with a warning naming the command above.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PATH = Path(__file__).with_name("catalog.json")
REGENERATE = "python -m repro.catalog"


@dataclass(frozen=True)
class Entry:
    """The part of a Repro the parent needs: where it is declared and whether it can run here."""

    name: str
    module: str  # the module that declares it (the child imports only that)
    summary: str
    devices: tuple[str, ...]
    requires: tuple[str, ...]
    precondition: str | None  # "module:function" returning a skip reason or None
    forkserver: str | None = None  # its children's fork server profile (started early)

    def missing_requirements(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m.split(".")[0]) is None]

    def unmet_precondition(self) -> str | None:
        if self.precondition is None:
            return None
        module, function = self.precondition.split(":")
        return getattr(importlib.import_module(module), function)()


def entry(repro, module: str) -> Entry:
    pre = repro.precondition
    return Entry(repro.name, module, repro.summary, tuple(repro.devices), tuple(repro.requires),
                 f"{pre.__module__}:{pre.__qualname__}" if pre is not None else None,
                 repro.forkserver)


def generate() -> dict[str, Entry]:
    """The catalog as ``discover()`` sees it now (imports every repro module)."""
    from repro.registry import DECLARED_IN, discover

    return {name: entry(r, DECLARED_IN[name]) for name, r in discover().items()}


def _dump(entries: dict[str, Entry]) -> str:
    return json.dumps({"modules": sorted(repro_modules()),
                       "repros": [asdict(e) for e in entries.values()]}, indent=1) + "\n"


def repro_modules() -> set[str]:
    """The modules ``discover()`` imports, listed without importing them."""
    import repro as package
    from repro.registry import _RUNNER_MODULES

    return {f"repro.{i.name}" for i in pkgutil.iter_modules(package.__path__)
            if not (i.name.startswith("_") or i.ispkg or i.name in _RUNNER_MODULES)}


def load() -> dict[str, Entry]:
    """The committed catalog; ``generate()`` (with a warning) when the modules it was made
    from are not the package's modules now (one added or removed since)."""
    try:
        data = json.loads(PATH.read_text())
    except (OSError, ValueError):
        data = None
    if data is not None and set(data["modules"]) == repro_modules():
        return {r["name"]: Entry(**{k: tuple(v) if isinstance(v, list) else v
                                    for k, v in r.items()}) for r in data["repros"]}
    print(f"warning: {PATH.name} is out of date; regenerate it with `{REGENERATE}`",
          file=sys.stderr)
    return generate()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = _dump(generate())
    if argv == ["--check"]:
        if PATH.read_text() != text:
            print(f"{PATH} is out of date; regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
