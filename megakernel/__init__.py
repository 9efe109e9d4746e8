"""megakernel: one persistent GPU kernel per transformer decode step."""

__version__ = "0.1.0"
