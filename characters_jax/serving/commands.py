"""CLI sub-command of the generator worker: serve."""

from __future__ import annotations

from characters_jax.config.arguments import add_config_arguments


def _serve(args) -> int:
    from characters_jax.logs import setup_logging
    from characters_jax.serving.server import run_worker

    setup_logging("worker", args.log_level)
    return run_worker(args)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run a generator worker (CharacterService over gRPC)",
        description="A generator worker: one session at a time, a conversation (listening video on silence, speech "
                    "segments, interrupts) until the client ends it or a limit does. Health 'characters.v1.CharacterService' "
                    "is SERVING while idle (balancers place sessions by it), '' until it drains. SIGTERM drains: "
                    "NOT_SERVING at once, new sessions UNAVAILABLE, the live session goes on up to serve.drain_timeout_s, "
                    "then it is CANCELLED and the worker stops. The config's [serve] table holds the worker's other "
                    "settings (session limits, metrics port, TLS, bearer tokens, decoder placement, RPC limits): "
                    "--set serve.KEY=VALUE overrides one.")
    add_config_arguments(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (diffusion devices)")
    p.add_argument("--checkpoint", default="auto",
                   help="weights directory; 'auto': the config's bundled weights (checkpoints/NAME) if the repository has them, "
                        "else random weights (of the config's seed); 'none': random weights")
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC port (and, unless serve.metrics_host, the metrics port) binds")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--state-file", default=None, help="JSON file written when ready: ports and pids")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_serve)
