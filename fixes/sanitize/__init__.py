"""Sanitizers that turn silent corruption into a named Python error, for any program or test
suite (``pytest --stackfix-sanitize``). Nothing optional is imported here: spmd_types (and
torchtitan, where installed) are looked up when ``mesh_sanitizer()`` is entered."""

from fixes.sanitize.mesh import MeshLostError, MeshSanitizer, mesh_sanitizer
from fixes.sanitize.recompute import (
    RecomputeMismatchError,
    RecomputeSanitizer,
    recompute_sanitizer,
)
from fixes.sanitize.storage import (
    ReleasedStorageError,
    StorageRelease,
    StorageSanitizer,
    storage_sanitizer,
)

__all__ = [
    "MeshLostError",
    "MeshSanitizer",
    "RecomputeMismatchError",
    "RecomputeSanitizer",
    "ReleasedStorageError",
    "StorageRelease",
    "StorageSanitizer",
    "mesh_sanitizer",
    "recompute_sanitizer",
    "storage_sanitizer",
]
