"""``recompute_sanitizer(values=...)``'s modes, in a module that imports nothing: the pytest
plugin checks ``--stackfix-sanitize=recompute:MODE`` without importing torch."""

VALUES = ("all", "sampled", "none")
