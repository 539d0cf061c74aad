"""CLI sub-command of the decoder process: decode-serve."""

from __future__ import annotations

from characters_jax.config.arguments import add_config_arguments


def _decode_serve(args) -> int:
    from characters_jax.decoder.process import run_decoder
    from characters_jax.logs import setup_logging

    setup_logging("decoder", args.log_level)
    return run_decoder(args)


def register(subparsers) -> None:
    p = subparsers.add_parser("decode-serve", help="run the decoder process (DecoderService over gRPC)")
    add_config_arguments(p, default="small")
    p.add_argument("--listen", default="127.0.0.1:50052", help="host:port or unix:PATH")
    p.add_argument("--checkpoint", default="auto", help="weights directory of the VAE (as serve's --checkpoint; random weights of the config's seed without)")
    p.add_argument("--state-file", default=None)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_decode_serve)
