"""Who may use the viewer's gateway: pages of this gateway, on this machine.

The gateway listens on loopback, but a browser on this machine can be made to send requests
to it by any site:
- DNS rebinding: a site's name made to resolve to 127.0.0.1; its requests reach the gateway
  with that name in `Host`. So every request's Host must be a loopback name of the address
  the gateway serves on, with its port ("127.0.0.1:PORT", "localhost:PORT").
- Cross-site posts: a foreign page's form or fetch with a "simple" content type (text/plain
  needs no CORS preflight). So a state-changing request's `Origin`, when present, must be the
  gateway's own origin; where a route requires it (/offer), an absent Origin is refused too
  (browsers always send Origin on POST); and a JSON route requires
  `Content-Type: application/json`, which a foreign page cannot send without a preflight that
  the gateway never answers.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import urllib.parse

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclasses.dataclass(frozen=True)
class RouteRules:
    """What a state-changing route requires beyond a good Host and no foreign Origin."""

    origin_required: bool = False  # refuse a request without an Origin header
    json_body: bool = False  # refuse a body that is not Content-Type: application/json


@dataclasses.dataclass(frozen=True)
class Refusal:
    status: int  # HTTP status: 400 (no Host), 403 (foreign Host or Origin), 415 (content type)
    message: str


def _split_host(value: str) -> tuple[str, int | None]:
    """"name:port" / "[v6]:port" / "name" -> (lowercase name without brackets, port or None).
    Raises ValueError for a malformed value."""
    parts = urllib.parse.urlsplit("//" + value)
    if parts.hostname is None or parts.path or parts.query or parts.fragment or parts.username is not None:
        raise ValueError(value)
    return parts.hostname.lower(), parts.port


def serving_names(address: str) -> frozenset[str]:
    """The names a page may use for the gateway's listening address: the address itself,
    and "localhost" where the address is a loopback one."""
    ip = ipaddress.ip_address(address)
    return frozenset({str(ip), "localhost"} if ip.is_loopback else {str(ip)})


def _own(name: str, port: int | None, address: str, bound_port: int) -> bool:
    return name in serving_names(address) and (port if port is not None else 80) == bound_port


def check_request(method: str, headers, sockname: tuple | None, rules: RouteRules = RouteRules()) -> Refusal | None:
    """None if the request may go on, else why not. headers: a case-insensitive mapping (the
    request's); sockname: the listening socket's (address, port, ...) the request came in on."""
    if not sockname:
        return Refusal(400, "the connection is closed")
    address, bound_port = sockname[0], sockname[1]
    host = headers.get("Host", "")
    try:
        name, port = _split_host(host)
    except ValueError:
        return Refusal(400, "the request has no valid Host header")
    if not _own(name, port, address, bound_port):
        literal = f"[{address}]" if ":" in address else address
        return Refusal(403, f"this viewer answers only as http://{literal}:{bound_port}/ or http://localhost:{bound_port}/ "
                            f"(the request was for host {host[:100]!r}); open the page at that address")
    if method.upper() in SAFE_METHODS:
        return None
    origin = headers.get("Origin")
    if origin is None:
        if rules.origin_required:
            return Refusal(403, "a request without an Origin header is refused here; use the viewer's page")
    else:
        try:
            parts = urllib.parse.urlsplit(origin)
            same = parts.scheme == "http" and not parts.path and _split_host(parts.netloc) == (name, port)
        except ValueError:
            same = False
        if not same:
            return Refusal(403, f"a request from another site ({origin[:100]}) is refused; only the viewer's own page may post here")
    if rules.json_body:
        ctype = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return Refusal(415, f"the body must be sent as Content-Type: application/json, got {ctype[:60] or 'none'!r}")
    return None
