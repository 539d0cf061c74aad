"""The worker's HTTP endpoint on the metrics port: /healthz (liveness: 200 or 503) and, on
every other path, Prometheus metrics. Binds the host it is given, IPv4 or IPv6.
`scrape` reads that endpoint back (tools and tests)."""

from __future__ import annotations

import re
import socket
import urllib.request
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client as prom

Liveness = Callable[[], tuple[bool, str]]
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$")


def scrape(host: str, port: int, timeout: float = 10.0) -> dict[str, float]:
    """The samples of the Prometheus text at http://host:port/metrics, keyed as written
    ('name' or 'name{label="value",...}')."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout).read().decode()
    return {m.group(1): float(m.group(2)) for m in map(_SAMPLE.match, text.splitlines()) if m}


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass


class MetricsHttpServer:
    def __init__(self, registry: prom.CollectorRegistry, host: str, port: int, liveness: Liveness | None = None):
        """Serves at once, on a thread; port 0: any free port (`self.port` is the bound one).
        liveness() -> (alive, message) answers /healthz (404 without one)."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsWSGIServer", (ThreadingMixIn, WSGIServer), {"address_family": family, "daemon_threads": True})
        self._metrics_app = prom.make_wsgi_app(registry)
        self._liveness = liveness
        self._httpd = make_server(host, port, self._app, server_class, handler_class=_QuietHandler)
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def _app(self, environ, start_response):
        if environ.get("PATH_INFO") != "/healthz":
            return self._metrics_app(environ, start_response)
        if self._liveness is None:
            status, body = "404 Not Found", "no liveness check on this server"
        else:
            alive, body = self._liveness()
            status = "200 OK" if alive else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [(body + "\n").encode()]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
