"""CLI sub-command of the client library: talk."""

from __future__ import annotations

from characters_jax.config.arguments import add_set_argument

CREDENTIALS_HELP = ("TLS and a bearer token for the workers: a TOML file with ca, cert, key, token_file, server_name "
                    "(paths relative to it; all optional); without it the connection is plaintext")


def _talk(args) -> int:
    from characters_jax.client.talk import talk_command

    return talk_command(args)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "talk", help="talk to a worker: image + WAV in, MP4 out",
        description="One session: the WAV as one speech segment from the first frame, the video written to an MP4. "
                    "The session opens on its own Converse stream, so --server may be a set of workers: the first idle one "
                    "takes it (gRPC round_robin with health checks, waitForReady, retries of RESOURCE_EXHAUSTED).")
    p.add_argument("--server", default="127.0.0.1:50051",
                   help="a worker (host:port), a comma list of workers (h1:p1,h2:p2), or a DNS name (dns:///name:port)")
    p.add_argument("--image", required=True)
    p.add_argument("--audio", required=True, help="WAV, 16 kHz mono s16le")
    p.add_argument("--out", required=True, help="MP4 to write")
    p.add_argument("--prompt", default="")
    p.add_argument("--report", default=None, help="also write the summary as JSON here")
    p.add_argument("--credentials", default=None, metavar="FILE", help=CREDENTIALS_HELP)
    add_set_argument(p, "talk (seed, fast, max_duration_s, idle_timeout_s, open_timeout_s, wait_for_worker: "
                        "client.talk.TalkOptions)")
    p.set_defaults(func=_talk)
