"""``recompute_sanitizer(values=...)``'s modes, in a module that imports nothing but the
standard library: the pytest plugin checks ``--stackfix-sanitize=recompute:MODE`` without
importing torch."""

import enum


class Values(enum.StrEnum):
    """How much of the values ``recompute_sanitizer()`` fingerprints."""

    ALL = "all"  # every op of the op stream, every saved tensor, every output
    SAMPLED = "sampled"  # every n-th op and saved tensor, each side's last, every output
    # no fingerprint kernels and no op stream: the metadata of what backward uses and the
    # writes outside the region only; an error is not located (``all`` locates it)
    NONE = "none"


VALUES = tuple(v.value for v in Values)
