"""The installed densepass version (recorded in saved indexes and reported by the service)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("densepass")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
