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
