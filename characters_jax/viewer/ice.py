"""Loopback-only ICE for the viewer: no media packet is addressed off this host.

aiortc's host gathering skips 127.0.0.1 and offers every other interface, and browsers offer
no loopback candidate by default (Chromium needs --allow-loopback-in-peer-connection,
Firefox media.peerconnection.ice.loopback = true). So the gateway gathers on 127.0.0.1
alone (`gather_on`) and keeps only the loopback UDP candidates of the page's offer
(`loopback_offer`), refusing an offer that has none with a message that says what to set.
"""

from __future__ import annotations

import ipaddress

LOOPBACK = "127.0.0.1"


class OfferError(ValueError):
    """The page's offer cannot be answered; the message is shown in the page."""


def _candidate_transport_address(line: str) -> tuple[str, str]:
    """`a=candidate:foundation component TRANSPORT priority ADDRESS port typ ...` -> (TRANSPORT, ADDRESS)."""
    parts = line.split()
    return (parts[2].lower(), parts[4]) if len(parts) > 5 else ("", "")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # an mDNS name (*.local) or garbage
        return False


def loopback_offer(sdp: str) -> str:
    """The offer with only its loopback UDP ICE candidates. Raises OfferError if none is left."""
    lines = sdp.replace("\r\n", "\n").split("\n")
    kept, dropped, loop = [], 0, 0
    for line in lines:
        if line.startswith("a=candidate:"):
            transport, address = _candidate_transport_address(line)
            if transport != "udp" or not _is_loopback(address):
                dropped += 1
                continue
            loop += 1
        kept.append(line)
    if not loop:
        raise OfferError(
            f"the browser offered no loopback ICE candidate ({dropped} other candidates); this viewer connects over "
            "127.0.0.1 only. Chromium: start it with --allow-loopback-in-peer-connection; Firefox: set "
            "media.peerconnection.ice.loopback to true in about:config")
    return "\r\n".join(kept)


def _ice_gatherers(pc) -> list:
    seen: dict[int, object] = {}
    for t in pc.getTransceivers():
        g = t.receiver.transport.transport.iceGatherer
        seen[id(g)] = g
    if pc.sctp is not None:
        g = pc.sctp.transport.transport.iceGatherer
        seen[id(g)] = g
    return list(seen.values())


async def gather_on(pc, host: str = LOOPBACK) -> None:
    """Gathers the peer connection's host candidates on `host` alone, before its answer is made.

    aiortc (1.16) offers no setting for the host addresses: its gatherer asks aioice for every
    interface except 127.0.0.1. Here each aioice connection gathers on `host` and is marked as
    gathered, so aiortc's own gathering (inside setLocalDescription) finds nothing to do."""
    for g in _ice_gatherers(pc):
        conn = g._connection  # aioice.Connection (aioice 0.13)
        if conn._local_candidates_start:
            continue
        conn._local_candidates_start = True
        for component in conn._components:
            conn._local_candidates += await conn.get_component_candidates(component=component, addresses=[host])
        conn._local_candidates_end = True
