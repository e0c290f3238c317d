"""Where a webhook may be sent: the allow-list, and addresses checked after resolution.

A callback URL is accepted only when its host matches ``MAEC_WEBHOOK_ALLOWED_HOSTS`` and
every address the host resolves to is public, or covered by an IP entry of that list.
The check runs at submission and again before each delivery attempt, which then connects
to an address this check returned (never resolving the name a second time), so a DNS
answer that changes in between cannot steer a delivery into the service's own network.
Standard library only: the settings module uses :meth:`AllowList.parse`.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from maec_core.service import MaecError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# host, port -> the addresses a connection could go to.
Resolver = Callable[[str, int], list[str]]

MAX_URL_LENGTH = 2048
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class CallbackRefused(MaecError):
    """A ``callback_url`` the service will not send to (``details.reason`` says why)."""

    code = "invalid_callback"


@dataclass(frozen=True)
class AllowList:
    """Host names (exact, or ``*.suffix`` for any name below it) and IP networks."""

    names: frozenset[str]
    suffixes: tuple[str, ...]
    networks: tuple[IPNetwork, ...]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        """ValueError naming the first entry that is neither a host name pattern nor an
        IP address or network."""
        names: set[str] = set()
        suffixes: list[str] = []
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().lower().rstrip(".")
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            name = entry.removeprefix("*.")
            if not _HOST_NAME.match(name) or _numeric_tld(name):
                raise ValueError(f"allowed webhook host {raw!r} is not a host name, "
                                 "'*.domain', an IP address or a CIDR network")
            if entry.startswith("*."):
                suffixes.append("." + name)
            else:
                names.add(name)
        return cls(frozenset(names), tuple(suffixes), tuple(networks))

    def allows_name(self, host: str) -> bool:
        return host in self.names or any(host.endswith(s) for s in self.suffixes)

    def covers(self, addr: IPAddress) -> bool:
        return any(addr in net for net in self.networks)


@dataclass(frozen=True)
class Target:
    """A checked callback: where to connect (``addresses``, in order) and what to ask."""

    scheme: str
    host: str
    port: int
    # Path and query as given ("/" when the URL has none).
    path: str
    addresses: tuple[str, ...]
    host_is_ip: bool

    @property
    def host_header(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return shown if _DEFAULT_PORTS[self.scheme] == self.port else f"{shown}:{self.port}"

    def url_for(self, address: str) -> str:
        """The URL with its host replaced by one checked address."""
        shown = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{shown}:{self.port}{self.path}"


def resolve_host(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def check_callback(url: str, allowed: AllowList, resolve: Resolver = resolve_host) -> Target:
    """The checked target of ``url``; :class:`CallbackRefused` when it may not be used."""
    scheme, host, port, path = _split(url)
    literal = _ip_or_none(host)
    if literal is not None:
        if not allowed.covers(literal):
            raise _refused("host_not_allowed", host)
        return Target(scheme, host, port, path, (str(literal),), True)
    if not _HOST_NAME.match(host) or _numeric_tld(host):
        raise _refused("invalid_host", host)
    if not allowed.allows_name(host):
        raise _refused("host_not_allowed", host)
    try:
        found = resolve(host, port)
    except (OSError, UnicodeError):
        found = []
    if not found:
        raise _refused("unresolvable", host)
    addresses = []
    for text in found:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
        if not is_public(addr) and not allowed.covers(addr):
            raise _refused("private_address", host, address=str(addr))
        addresses.append(str(addr))
    return Target(scheme, host, port, path, tuple(addresses), False)


def is_public(addr: IPAddress) -> bool:
    """A globally routed unicast address; IPv4 embedded in IPv6 judged as IPv4."""
    if isinstance(addr, ipaddress.IPv6Address):
        embedded = addr.ipv4_mapped or addr.sixtofour or (addr.teredo or (None, None))[1]
        if embedded is not None and not is_public(embedded):
            return False
    return addr.is_global and not addr.is_multicast


def _split(url: str) -> tuple[str, str, int, str]:
    if len(url) > MAX_URL_LENGTH or any(c.isspace() or ord(c) < 32 or ord(c) == 127
                                        for c in url):
        raise _refused("malformed", None)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise _refused("malformed", None) from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise _refused("scheme", None, scheme=scheme)
    if parts.username is not None or parts.password is not None:
        raise _refused("credentials_in_url", None)
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise _refused("malformed", None)
    if _ip_or_none(host) is None:
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise _refused("invalid_host", None) from None
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return scheme, host, port or _DEFAULT_PORTS[scheme], path


def _ip_or_none(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _numeric_tld(host: str) -> bool:
    # "2130706433" or "127.1" are addresses to some resolvers, never names.
    return host.rsplit(".", 1)[-1].isdigit()


_REASONS = {
    "malformed": "callback_url is not a valid absolute URL",
    "scheme": "callback_url must be http or https",
    "credentials_in_url": "callback_url must not carry credentials",
    "invalid_host": "callback_url's host is not a valid host name",
    "host_not_allowed": "callback_url's host is not in MAEC_WEBHOOK_ALLOWED_HOSTS",
    "unresolvable": "callback_url's host does not resolve",
    "private_address": "callback_url's host resolves to a private, loopback or "
                       "link-local address that MAEC_WEBHOOK_ALLOWED_HOSTS does not cover",
}


def _refused(reason: str, host: str | None, **details: str) -> CallbackRefused:
    extra = {"host": host} if host is not None else {}
    return CallbackRefused(_REASONS[reason], reason=reason, **extra, **details)
