"""CLI sub-command of the generator worker: serve."""

from __future__ import annotations

from characters_jax.config import add_engine_arguments


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
                    "NOT_SERVING at once, new sessions UNAVAILABLE, the live session goes on up to --drain-timeout, "
                    "then it is CANCELLED and the worker stops.")
    p.add_argument("--config", default="talking", help="config name or .toml path (default: the trained talking demonstrator)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (diffusion devices)")
    p.add_argument("--checkpoint", default="auto",
                   help="weights directory; 'auto': the config's bundled weights (checkpoints/NAME) if the repository has them, "
                        "else random weights; 'none': random weights")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--compile-cache", default="auto",
                   help="XLA's persistent compilation cache, so a restart does not compile again: a directory, 'off', "
                        "or 'auto' ($JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/characters-jax/xla)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=9464, help="Prometheus /metrics and liveness /healthz port (0: any, -1: off)")
    p.add_argument("--metrics-host", default=None, help="address the metrics port binds (default: --host)")
    p.add_argument("--decoder", default=None, help="address of a running decoder (host:port or unix:PATH); default: start and supervise one")
    p.add_argument("--decoder-device", default=None,
                   help="GPU of the started decoder: a visible index, a UUID, or 'cpu'; default: a GPU of its own "
                        "when the machine has more GPUs than --tp, else the generator's first GPU (shared)")
    p.add_argument("--decoder-memory-gib", type=float, default=None,
                   help="the decoder's device memory budget (default: estimated from the config)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="fraction of each generator GPU's memory the generator may take (default: all that the decoder "
                        "and the per-process reserves leave)")
    p.add_argument("--lead-chunks", type=int, default=3, help="how many chunks the step loop may run ahead of the client's playout")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds a READY session (CreateSession) waits for Converse")
    p.add_argument("--max-duration", type=float, default=3600.0,
                   help="longest session, seconds from RUNNING; a client may ask for less (ends COMPLETED, MAX_DURATION)")
    p.add_argument("--idle-timeout", type=float, default=120.0,
                   help="a session with no speech queued or playing and no client audio or control for this many seconds "
                        "ends COMPLETED (IDLE_TIMEOUT); a client may ask for less")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="on SIGTERM, how long the live session may go on before it is ended CANCELLED (DRAIN_TIMEOUT)")
    p.add_argument("--max-queued-audio", type=float, default=60.0,
                   help="seconds of speech a client may send ahead of its playback; more fails the session RESOURCE_EXHAUSTED")
    p.add_argument("--worker-id", default="", help="this worker's name in Session.worker_id (default: host name:port)")
    p.add_argument("--max-connection-age", type=float, default=0.0,
                   help="close each client connection gracefully after this many seconds (live streams go on), so clients of "
                        "a dns:/// target re-resolve and find new workers; 0: never")
    p.add_argument("--max-image-bytes", type=int, default=4 << 20)
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve over TLS with this certificate (chain); needs --tls-key")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="mutual TLS: clients must present a certificate signed by this CA (refused in the handshake otherwise)")
    p.add_argument("--auth-tokens", default=None, metavar="FILE",
                   help="bearer tokens, one a line ('#' comments), re-read when the file changes: every RPC but health checks "
                        "needs 'authorization: Bearer <token>' with one of them (UNAUTHENTICATED otherwise); needs TLS")
    p.add_argument("--state-file", default=None, help="JSON file written when ready: ports and pids")
    p.add_argument("--log-level", default="info")
    add_engine_arguments(p)
    p.set_defaults(func=_serve)
