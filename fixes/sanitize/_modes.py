"""``recompute_sanitizer(values=...)``'s modes, in a module that imports nothing but the
standard library: the pytest plugin checks ``--stackfix-sanitize=recompute:MODE`` without
importing torch."""

import enum


class Values(enum.StrEnum):
    """How much of the values ``recompute_sanitizer()`` fingerprints."""

    ALL = "all"  # every region fingerprinted; a detection located on the region's next round
    SAMPLED = "sampled"  # every n-th region of a call site, rotating; raised unlocated
    # no fingerprint kernels: the count and metadata of what backward uses and the state the
    # regions reach only; raised unlocated (``all`` locates it)
    NONE = "none"


VALUES = tuple(v.value for v in Values)
