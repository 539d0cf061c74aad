"""CLI sub-command of the WebRTC viewer: view."""

from __future__ import annotations

from characters_jax.client.commands import CREDENTIALS_HELP
from characters_jax.config.arguments import CONFIG_TABLES, add_set_argument


def _view(args) -> int:
    from characters_jax.viewer.gateway import view_command

    return view_command(args)


def register(subparsers) -> None:
    p = subparsers.add_parser("view", help="the character live in a web page (WebRTC, loopback only)")
    p.add_argument("--server", default=None, help="a running worker, or workers behind gRPC balancing (host:port, h1:p1,h2:p2, "
                                                  "dns:///name:port); default: start one for --config")
    p.add_argument("--config", default="talking", help="config of the worker started when --server is not given")
    p.add_argument("--checkpoint", default="auto", help="weights of the started worker (as serve's --checkpoint)")
    p.add_argument("--port", type=int, default=8080, help="the page's port on 127.0.0.1 (0: any free port)")
    p.add_argument("--image", default=None, help="default reference image (the page can upload another)")
    p.add_argument("--prompt", default="a friendly character, talking")
    p.add_argument("--out", default="out", help="where the started worker's log goes")
    p.add_argument("--state-file", default=None, help="JSON file: the page's URL and port, the worker's state")
    p.add_argument("--log-level", default="info")
    p.add_argument("--credentials", default=None, metavar="FILE", help=CREDENTIALS_HELP + " (with --server)")
    add_set_argument(p, "view (the bridge: prebuffer_chunks, audio_rate, mic_timeout_s, connect_timeout_s, "
                        "stats_period_s); the started worker's: " + CONFIG_TABLES)
    p.set_defaults(func=_view)
