"""CLI sub-command of the demo: demo."""

from __future__ import annotations

from characters_jax.config import add_engine_arguments


def _demo(args) -> int:
    from characters_jax.demo.run import demo_command

    return demo_command(args)


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="decoder + worker + client on localhost: out/demo.mp4")
    p.add_argument("--config", default="talking", help="config (default: the trained talking demonstrator)")
    p.add_argument("--checkpoint", default="auto", help="weights directory (as serve's --checkpoint)")
    p.add_argument("--out", default="out")
    p.add_argument("--image", default=None, help="reference image (default: the weights' held-out demo portrait, else a drawn one)")
    p.add_argument("--audio", default=None, help="speech WAV, 16 kHz mono (default: the weights' held-out demo speech, else a "
                                                 "synthesized clip)")
    p.add_argument("--prompt", default="a friendly character, talking")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_engine_arguments(p)
    p.set_defaults(func=_demo)
