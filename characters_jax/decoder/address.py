"""Where the decoder link may run: it carries no TLS and no authentication, so it stays on
this machine (a Unix socket or a loopback address), on both ends."""

from __future__ import annotations

import ipaddress


def require_loopback(address: str, what: str = "decoder address") -> str:
    """`address` if it stays on this machine: unix:PATH, or host:port with host a loopback IP
    address or 'localhost'. Raises ValueError (its message starts with `what`) otherwise."""
    if address.startswith(("unix:", "unix-abstract:")):
        return address
    entry = address.removeprefix("ipv4:").removeprefix("ipv6:")
    host, _, port = entry[1:].partition("]:") if entry.startswith("[") else entry.rpartition(":")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback or not port.isdigit():
        raise ValueError(f"{what} {address!r}: the decoder link has no TLS and no authentication, so it stays on this machine: "
                         "give unix:PATH or a loopback address (127.0.0.1:PORT, [::1]:PORT, localhost:PORT)")
    return address
