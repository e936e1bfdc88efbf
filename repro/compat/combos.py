"""The released stack combinations the compatibility matrix runs, one virtualenv each.

Why these: torch 2.13.0 (the CPU build CI uses) against 2.15.0 (newest; a CUDA build on PyPI,
which runs on CPU); spmd-types 0.2.3 (what torchtitan 0.3.0 pins) against 0.3.1 (then without
torchtitan); megatron-core 0.16.1 (newest for Python 3.11) against 0.19.2 (needs Python 3.12);
megatron-core 0.17.1 and 0.18.2 (0.18.x: MTP + full recompute's padding_mask TypeError, verl #7326);
verl 0.8.0 / 0.9.1 as released (pure-python wheels, unpacked beside the venv); torch-remat 0.2.2
(torchtitan #4497 moves activation checkpointing to it).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

PYTHONS = ("3.11", "3.12")
SYSTEM_TORCH = "system"  # the base interpreter's own torch (a venv with system site-packages)
VERL_RELEASES = ("0.8.0", "0.9.1")
VERL_CHOICES = ("none", *VERL_RELEASES, "both")
_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Combination:
    """One venv: ``pip install torch==<torch> <packages...>`` in one resolver run (so nothing
    moves torch), verl releases unpacked beside it, then ``python -m repro --json``.

    ``absent`` names what this combination leaves out on purpose (an importable module) and
    why; a repro skipped for it is reported "could not run: <why>" (verl releases not named in
    ``verl`` are added: ``absent_reasons``). ``lift_pip_cap`` installs with
    no pip configuration files (this machine's config caps torch at 2.14.1)."""

    name: str
    python: str
    torch: str
    packages: tuple[str, ...] = ()
    verl: str = "none"
    absent: tuple[tuple[str, str], ...] = ()
    lift_pip_cap: bool = False

    def __post_init__(self):
        if not _NAME.match(self.name):
            raise ValueError(f"combination name {self.name!r}: use lowercase letters, digits, '.', '-'")
        if self.python not in PYTHONS:
            raise ValueError(f"{self.name}: python must be one of {PYTHONS}, got {self.python!r}")
        if self.verl not in VERL_CHOICES:
            raise ValueError(f"{self.name}: verl must be one of {VERL_CHOICES}, got {self.verl!r}")
        if self.torch != SYSTEM_TORCH and not re.fullmatch(r"\d+\.\d+\.\d+", self.torch):
            raise ValueError(f"{self.name}: torch must be an exact release like 2.13.0 or "
                             f"{SYSTEM_TORCH!r}, got {self.torch!r}")
        if any(p.split("==")[0].strip().lower() == "torch" for p in self.packages):
            raise ValueError(f"{self.name}: give torch in torch=, not in packages")

    @property
    def verl_versions(self) -> tuple[str, ...]:
        if self.verl == "both":
            return VERL_RELEASES
        return () if self.verl == "none" else (self.verl,)

    @property
    def absent_reasons(self) -> dict[str, str]:
        """``absent`` plus each verl release this combination does not install."""
        left_out = {f"verl {v}": f"verl {v} is not in this combination (verl: {self.verl})"
                    for v in VERL_RELEASES if v not in self.verl_versions}
        return {**left_out, **dict(self.absent)}

    @property
    def requirements(self) -> tuple[str, ...]:
        if self.torch == SYSTEM_TORCH:
            return self.packages
        return (f"torch=={self.torch}", *self.packages)

    def install_spec(self) -> dict:
        """What the venv is built from: a venv whose recorded spec equals this is reused."""
        data = asdict(self)
        data.pop("absent")
        return data


_TITAN = ("torchtitan==0.3.0", "spmd-types==0.2.3", "triton")
_NO_TITAN = (("torchtitan", "torchtitan 0.3.0 pins spmd_types==0.2.3"),)

COMBINATIONS: tuple[Combination, ...] = (
    Combination(
        name="py3.11-torch2.13-spmd0.2.3-mcore0.16.1", python="3.11", torch="2.13.0",
        packages=(*_TITAN, "megatron-core==0.16.1", "numpy", "torch-remat==0.2.2"), verl="both",
    ),
    Combination(
        name="py3.11-torch2.15-spmd0.2.3-mcore0.16.1", python="3.11", torch="2.15.0",
        packages=(*_TITAN, "megatron-core==0.16.1", "numpy", "torch-remat==0.2.2"), verl="both",
        lift_pip_cap=True,
    ),
    Combination(
        name="py3.11-torch2.13-spmd0.3.1-mcore0.16.1", python="3.11", torch="2.13.0",
        # triton: Megatron-LM dev's megatron.core imports it (the mHC repros); _TITAN brings it
        # to the other combinations ("No module named 'triton'" without it)
        packages=("spmd-types==0.3.1", "triton", "megatron-core==0.16.1", "numpy",
                  "torch-remat==0.2.2"),
        verl="0.9.1", absent=_NO_TITAN,
    ),
    Combination(
        name="py3.12-torch2.15-spmd0.2.3-mcore0.19.2", python="3.12", torch="2.15.0",
        packages=(*_TITAN, "megatron-core==0.19.2", "numpy", "torch-remat==0.2.2"), verl="both",
        lift_pip_cap=True,
    ),
    *(Combination(
        name=f"py3.12-torch2.13-spmd0.2.3-mcore{mcore}", python="3.12", torch="2.13.0",
        packages=(*_TITAN, f"megatron-core=={mcore}", "numpy", "torch-remat==0.2.2"), verl="0.9.1",
    ) for mcore in ("0.17.1", "0.18.2")),
)


# For a GPU column on a host that cannot install a CUDA torch (no network, small uploads): its
# own torch, the small wheels beside it (--wheels DIR). torchtitan 0.3.0's models need torch >=
# ~2.12, so it is left out where the host's torch is older.
CUDA_COMBINATIONS: tuple[Combination, ...] = (
    Combination(
        name="py3.12-torch-system-spmd0.2.3-mcore0.19.2", python="3.12", torch=SYSTEM_TORCH,
        packages=("spmd-types==0.2.3", "megatron-core==0.19.2", "torch-remat==0.2.2"),
        verl="both", absent=(("torchtitan", "torchtitan 0.3.0's models need torch >= 2.12"),),
    ),
)


def for_device(device: str) -> tuple[Combination, ...]:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of ('cpu', 'cuda'), got {device!r}")
    return COMBINATIONS if device == "cpu" else CUDA_COMBINATIONS


def by_name(names, device: str = "cpu") -> tuple[Combination, ...]:
    """The ``device`` combinations named (all for an empty selection); ValueError naming the
    known ones."""
    known = {c.name: c for c in for_device(device)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {device} combination {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(known)}")
    return tuple(known[n] for n in names) if names else tuple(known.values())
