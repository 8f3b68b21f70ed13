"""The package's version, in a module of its own: the daemon reports it without importing the public API."""

__version__ = "0.1.0"
