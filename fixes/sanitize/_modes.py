"""``recompute_sanitizer(values=...)``'s modes, in a module that imports nothing but the
standard library: the pytest plugin checks ``--stackfix-sanitize=recompute:MODE`` without
importing torch."""

import enum


class Values(enum.StrEnum):
    """How much of the values ``recompute_sanitizer()`` fingerprints."""

    ALL = "all"  # every op of the op stream, every saved tensor, every output
    SAMPLED = "sampled"  # every n-th op and saved tensor, each side's last, every output
    NONE = "none"  # no fingerprint kernels: metadata and writes outside the region only


VALUES = tuple(v.value for v in Values)
