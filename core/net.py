"""Addresses strangers report for others to dial: resolved once, and public only.

A ring stage's neighbours and an expert coordinator dial what a host reported. A stranger
must not make them dial their own network (loopback, private ranges, link-local), so the
name is resolved here, once, and the address handed on is the checked IP: a name that
resolves elsewhere later changes nothing."""

from __future__ import annotations

import ipaddress
import socket


class AddressUnresolvable(ValueError):
    pass


class AddressNotPublic(ValueError):
    def __init__(self, ip: str) -> None:
        super().__init__(ip)
        self.ip = ip


def public_address(name: str, port: int) -> str:
    """`IP:PORT` (`[IP]:PORT` for IPv6) for `name`, when every address it resolves to is a
    public unicast one; raises `AddressUnresolvable` or `AddressNotPublic` (naming the IP)."""
    try:
        found = socket.getaddrinfo(name.strip("[]"), port, type=socket.SOCK_STREAM)
        ips = sorted({ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in found}, key=str)
    except (OSError, UnicodeError, ValueError) as exc:
        raise AddressUnresolvable(str(exc)) from exc
    for ip in ips:
        plain = (ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip
        if not plain.is_global or plain.is_multicast:
            raise AddressNotPublic(str(ip))
    ip = ips[0]
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
