"""Errors that densepass reports to users as one clear line (the CLI prints them without a trace), and
the warning category for input it accepts but that deserves a look (the CLI prints each as one line)."""


class DensepassError(Exception):
    """Base class for every error caused by bad input or configuration."""


class DataError(DensepassError):
    """A dataset file is missing, malformed or inconsistent."""


class ConfigError(DensepassError):
    """A configuration value or key is invalid."""


class DataWarning(UserWarning):
    """Input that is read anyway (a row skipped, a repeat ignored); one warning per file and kind, counted."""


class DiskError(DensepassError):
    """A write failed for want of space or permission (a full disk, a quota, a read-only place): ``code`` is its
    errno, ``needs`` about how many bytes it needed where known (``io.disk_errors``)."""

    def __init__(self, message: str, code: int, needs: int | None = None) -> None:
        super().__init__(message)
        self.code, self.needs = code, needs
