"""Errors that densepass reports to users as one clear line (the CLI prints them without a trace)."""


class DensepassError(Exception):
    """Base class for every error caused by bad input or configuration."""


class DataError(DensepassError):
    """A dataset file is missing, malformed or inconsistent."""


class ConfigError(DensepassError):
    """A configuration value or key is invalid."""


class DataWarning(UserWarning):
    """Something in the input was skipped or repaired; reported once per file and kind, with a count."""
