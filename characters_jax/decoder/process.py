"""The decoder process (`decode-serve`): compiles the VAE, then serves DecoderService on a
Unix socket or a loopback address until SIGTERM. It writes a small JSON state file (port,
pid, device, memory) once it serves."""

from __future__ import annotations

import logging
import os
import sys
import time

from characters_jax.decoder.address import require_loopback
from characters_jax.processes import stop_on_signals, write_state_file

log = logging.getLogger("characters_jax.decoder.process")


def run_decoder(args) -> int:
    """`decode-serve`: compile, then serve DecoderService until SIGTERM."""
    try:
        require_loopback(args.listen, "--listen")
    except ValueError as err:
        print(f"characters-jax decode-serve: {err}", file=sys.stderr)
        return 2
    from characters_jax.config.arguments import config_from_args
    from characters_jax.decoder.runtime import VaeRuntime
    from characters_jax.decoder.service import start_decoder_server
    from characters_jax.weights.directory import WeightsError, checkpoint_path

    stop = stop_on_signals()
    cfg = config_from_args(args)
    t0 = time.perf_counter()
    try:
        rt = VaeRuntime(cfg, seed=cfg.seed, checkpoint=checkpoint_path(args.checkpoint, cfg.name))  # checked there
    except (WeightsError, FileNotFoundError) as err:
        print(f"characters-jax decode-serve: --checkpoint: {err}", file=sys.stderr)
        return 2
    rt.warmup()
    server, port = start_decoder_server(rt, args.listen)
    if port == 0:
        log.error("could not bind", extra={"fields": {"listen": args.listen}})
        return 1
    import jax

    from characters_jax.device_memory import device_memory

    memory = device_memory()
    log.info("decoder ready", extra={"fields": {"listen": args.listen, "port": port, "config": cfg.name, "device": str(jax.devices()[0]), "startup_s": round(time.perf_counter() - t0, 2), **memory}})
    write_state_file(args.state_file, {"port": port, "pid": os.getpid(), "device": str(jax.devices()[0]), "memory": memory})
    stop.wait()
    server.stop(grace=1).wait()
    log.info("decoder stopped")
    return 0
