"""The package's version: one value, at the bottom of the layers (the manifest writer records it)."""

__version__ = "0.1.0"
