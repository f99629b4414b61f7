"""Settings of the search service: request limits, micro-batching, read timeouts and the Host allow-list, with
the command-line flags for them, and the checks of the address it listens on (all without importing FastAPI)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
import socket
from dataclasses import dataclass, field

from densepass.errors import ConfigError

API_KEY_ENV = "DENSEPASS_API_KEY"  # the service's key when --api-key is not given
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")  # always accepted in the Host header, with any port
_NAME = re.compile(r"(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*")


def _limit(default: float, help: str, low: float, high: float) -> dataclasses.Field:
    return field(default=default, metadata={"help": help, "min": low, "max": high})


def host_name(host: str) -> str:
    """``host`` (a Host header's name part, an ``--allowed-hosts`` entry or a ``--host`` address) compared the
    way the allow-list compares: lowercase, IPv6 without brackets, without one trailing dot."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host[:-1] if host.endswith(".") and len(host) > 1 else host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class ServeSettings:
    """Limits, micro-batching, read timeouts and Host allow-list of the search service; every field has a
    documented default and range (its ``help``), checked when the settings are made (a one-line ``ConfigError``
    naming the flag).

    ``max_batch_size=1`` turns micro-batching off: each request is its own searcher call.
    """

    max_queries_per_request: int = _limit(64, "queries in one POST /search", 1, 10_000)
    max_query_chars: int = _limit(1000, "characters in one query", 1, 100_000)
    max_k: int = _limit(100, "largest k (hits per query) a request may ask for", 1, 10_000)
    max_body_bytes: int = _limit(1_048_576, "bytes in a request body", 1, 64 * 1_048_576)
    max_batch_size: int = _limit(
        64,
        "queries in one searcher call, gathered from concurrent requests (1: batching off, one call per request); "
        "a request is never split, and one larger than this is searched alone",
        1,
        4096,
    )
    max_wait_ms: float = _limit(
        2.0, "how long a batch waits for more queries after its first one arrived, in milliseconds", 0, 1000
    )
    max_queue: int = _limit(
        1024, "queries waiting for the searcher; beyond it requests get 503 with Retry-After", 1, 1_000_000
    )
    read_timeout_s: float = _limit(
        10.0,
        "seconds a client has to send a request's headers, and again to send its body; a slower body gets 408 and "
        "the connection closed, slower headers get the connection closed",
        0.05,
        600,
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "comma-separated host names (or IP addresses) accepted in the Host header, with any port, besides "
            "localhost, 127.0.0.1, [::1] and the --host address when it is a specific one; '*.example.com' accepts "
            "its subdomains, '*' any host; any other Host gets 400 (this stops DNS rebinding from a browser)"
        },
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "allowed_hosts":
                continue
            value, real, low, high = (
                getattr(self, f.name),
                isinstance(f.default, float),
                f.metadata["min"],
                f.metadata["max"],
            )
            kinds = (int, float) if real else int
            # the comparison also refuses NaN (never in range) and infinities
            if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
                kind = "a finite number" if real else "an integer"
                within = f"from {_number(low)} to {_number(high)}"
                raise ConfigError(f"{_flag(f.name)} (serve setting {f.name}) must be {kind} {within}, got {value!r}")
        if self.max_queries_per_request > self.max_queue:
            raise ConfigError(
                f"--max-queries-per-request ({self.max_queries_per_request}) exceeds --max-queue "
                f"({self.max_queue}): such a request could never be queued"
            )
        hosts = self.allowed_hosts
        if isinstance(hosts, str) or not isinstance(hosts, (tuple, list)) or not all(isinstance(h, str) for h in hosts):
            raise ConfigError(f"--allowed-hosts (serve setting allowed_hosts) must be a list of names, got {hosts!r}")
        object.__setattr__(self, "allowed_hosts", tuple(host_name(h) for h in hosts))
        for host in self.allowed_hosts:
            if host != "*" and not _is_ip(host) and not _NAME.fullmatch(host):
                hint = " (any port is accepted; give the name alone)" if ":" in host else ""
                raise ConfigError(
                    f"--allowed-hosts: {host!r} is not a host name, '*.domain', '*' or an IP address{hint}"
                )

    @property
    def batching(self) -> bool:
        """Whether concurrent requests are searched together (``max_batch_size > 1``)."""
        return self.max_batch_size > 1

    def host_allow_list(self, bound_host: str | None = None) -> tuple[str, ...] | None:
        """The names accepted in a request's Host header (any port; compared after :func:`host_name`), or None
        when any host is (``*``): the loopback names, ``bound_host`` when it is a specific address (not
        ``0.0.0.0`` or ``::``), and :attr:`allowed_hosts`."""
        if "*" in self.allowed_hosts:
            return None
        names = [*LOOPBACK_NAMES]
        if bound_host and not is_wildcard(bound_host):
            names.append(host_name(bound_host))
        names.extend(self.allowed_hosts)
        return tuple(dict.fromkeys(names))


def is_wildcard(host: str) -> bool:
    """Whether listening on ``host`` means every interface (``0.0.0.0``, ``::``, or empty)."""
    name = host_name(host)
    return name == "" or (_is_ip(name) and ipaddress.ip_address(name).is_unspecified)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (``localhost`` or a loopback address)."""
    name = host_name(host)
    return name == "localhost" or (_is_ip(name) and ipaddress.ip_address(name).is_loopback)


def check_address(host: str, port: int) -> None:
    """One-line ``ConfigError`` for a ``--port`` outside 0..65535 (0: any free port) or an empty ``--host``."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"--port must be an integer from 0 to 65535 (0: any free port), got {port!r}")
    if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
        raise ConfigError(f"--host must be an address or host name to listen on, got {host!r}")


def check_can_listen(host: str, port: int) -> None:
    """One-line ``ConfigError`` when ``host`` does not resolve or ``host:port`` cannot be bound now (say the
    port is taken), found by binding a socket and closing it, before anything slow (loading an index) starts."""
    check_address(host, port)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as err:
        raise ConfigError(f"cannot listen on --host {host} --port {port}: {err.strerror or err}") from None


def exposure_warning(host: str, port: int) -> str | None:
    """The one-line warning for listening beyond this machine (``--host`` not loopback) without a key, else None."""
    if is_loopback(host):
        return None
    shown = f"[{host_name(host)}]" if ":" in host_name(host) else host
    return (
        f"--host {host}: the service has no authentication; anyone who can reach {shown}:{port} can search the index "
        f"(give it a key: --api-key or ${API_KEY_ENV}; requests must also name an allowed Host: see --allowed-hosts)"
    )


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`ServeSettings` field (e.g. ``--max-batch-size``, ``--read-timeout-s``,
    ``--allowed-hosts``) to ``parser``."""
    for f in dataclasses.fields(ServeSettings):
        if f.name == "allowed_hosts":
            parser.add_argument(_flag(f.name), default="", metavar="HOSTS", help=f.metadata["help"])
            continue
        parser.add_argument(
            _flag(f.name),
            type=type(f.default),
            default=f.default,
            help=f"{f.metadata['help']} (default: {f.default}; "
            f"from {_number(f.metadata['min'])} to {_number(f.metadata['max'])})",
        )


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """The :class:`ServeSettings` given by the flags of :func:`add_settings_arguments` (checked)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeSettings)}
    hosts = values["allowed_hosts"]
    if isinstance(hosts, str):
        values["allowed_hosts"] = tuple(h.strip() for h in hosts.split(",") if h.strip())
    return ServeSettings(**values)


def serve_api_key(flag: str | None) -> str | None:
    """The service's API key: ``--api-key``, else ``$DENSEPASS_API_KEY``, else None (no key). A key that is
    empty, has whitespace or is shorter than 16 characters is a one-line ``ConfigError``."""
    import os

    key = flag if flag is not None else (os.environ.get(API_KEY_ENV) or None)  # set but empty: no key
    if key is None:
        return None
    return check_api_key(key, "--api-key" if flag is not None else f"${API_KEY_ENV}")


def check_api_key(key: str, source: str = "api_key") -> str:
    """``key`` if it can be an API key (16 printable characters or more, no whitespace), else a one-line
    ``ConfigError`` naming ``source``: an empty key would otherwise mean no key, an open service."""
    if not isinstance(key, str) or len(key) < 16 or any(c.isspace() for c in key) or not key.isprintable():
        size = len(key) if isinstance(key, str) else type(key).__name__
        raise ConfigError(f"{source} must be at least 16 printable characters without spaces, got {size}")
    return key


def check_access_log(target: str) -> None:
    """One-line ``ConfigError`` for an ``--access-log`` that cannot be appended to (``-``: stderr; ``off``)."""
    import os
    from pathlib import Path

    if target in ("-", "off"):
        return
    path = Path(target)
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise ConfigError(f"--access-log {target}: not a regular file")
    if not path.parent.is_dir() or not os.access(path.parent if not path.exists() else path, os.W_OK):
        raise ConfigError(f"--access-log {target}: cannot write there")


def add_operation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of how the service runs: ``--api-key``, ``--access-log``, ``--workers``."""
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"every route but /health needs 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set; the "
        "variable keeps the key out of the process list)",
    )
    parser.add_argument(
        "--access-log",
        default="-",
        metavar="FILE",
        help="one JSON line per request (time, route, status, latency, batch size): '-' stderr (the default), a "
        "file to append to, or 'off'",
    )
    parser.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="worker processes behind the one port, each with its own copy of the index and models (default 1)",
    )


def _workers(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 64, got {value!r}")
    return int(value)
