"""CLI sub-command of the demo: demo."""

from __future__ import annotations

from characters_jax.config.arguments import add_config_arguments


def _demo(args) -> int:
    from characters_jax.demo.run import demo_command

    return demo_command(args)


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="decoder + worker + client on localhost: out/demo.mp4",
                              description="Starts `serve` for --config (with the same --set items: engine, cache, serve, "
                                          "...), waits up to serve.startup_timeout_s for it, runs a session at real-time "
                                          "pace and writes OUT/demo.mp4 and OUT/demo_report.json.")
    add_config_arguments(p)
    p.add_argument("--checkpoint", default="auto", help="weights directory (as serve's --checkpoint)")
    p.add_argument("--out", default="out")
    p.add_argument("--image", default=None, help="reference image (default: the weights' held-out demo portrait, else a drawn one)")
    p.add_argument("--audio", default=None, help="speech WAV, 16 kHz mono (default: the weights' held-out demo speech, else a "
                                                 "synthesized clip)")
    p.add_argument("--prompt", default="a friendly character, talking")
    p.set_defaults(func=_demo)
