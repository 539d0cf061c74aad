"""The generator worker's process (`serve`).

It loads the config and the generator, starts (and supervises) its decoder process
unless given one, compiles everything once, then serves CharacterService + grpc.health.v1 +
reflection on one port (build_worker, composition.py) and Prometheus metrics on another. It writes a
small JSON state file (ports, pids) when ready. SIGTERM (or SIGINT) drains: NOT_SERVING at
once, new sessions refused (UNAVAILABLE), the live session goes on up to the [serve] table's
drain_timeout_s and is then ended CANCELLED; then the worker stops. Everything but the
config, tp, weights, address, state file and log level comes from the [serve] table.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from characters_jax.processes import child_env, stop_on_signals, write_state_file

if TYPE_CHECKING:
    from characters_jax.serving.warmup import WarmupReport

log = logging.getLogger("characters_jax.serving.server")


def _use_compile_cache(choice: str) -> str | None:
    """Points XLA's persistent compilation cache at a directory ('auto': the environment's,
    else ~/.cache/characters-jax/xla; 'off': none). Returns the directory in use."""
    import jax

    if choice == "off":
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") if choice == "auto" else choice
    path = path or str(pathlib.Path.home() / ".cache" / "characters-jax" / "xla")
    pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def _compile_generator(cfg, tp: int, random_weights: bool, placement):
    """Compiles the generator's programs (the step, every prompt bucket's prefill, the init
    programs) from abstract shapes before any weight exists, so XLA's autotuning has the
    whole pool, then checks the plan with their measured working memory. Returns
    (programs, the memory plan's line, compile seconds). Raises PlacementError."""
    from characters_jax.engine.generator import compile_programs
    from characters_jax.engine.step import Engine
    from characters_jax.parallel.sharding import make_mesh
    from characters_jax.serving.placement import check_measured, memory_plan_line, pool_bytes

    t0 = time.perf_counter()
    engine = Engine(cfg, make_mesh(tp))
    programs = compile_programs(engine, random_weights=random_weights)
    compile_s = time.perf_counter() - t0
    pool = pool_bytes(engine.mesh.devices.flat)
    m = programs.memory
    need = check_measured(cfg, placement, m.params, m.state, m.working, pool)
    return programs, memory_plan_line(placement, need, pool), compile_s


def warmup_fields(warmup: "WarmupReport", compile_s: float) -> dict:
    """The warm-up as the state file and the log give it: compile_s (the programs' compile
    and first runs), step_ms (median of the timed steps), fps_capacity, real_time, memory."""
    from characters_jax.device_memory import device_memory

    return {"compile_s": round(compile_s + warmup.warmup_s, 2), "step_ms": round(warmup.step_ms, 2),
            "fps_capacity": round(warmup.fps_capacity, 1), "real_time": warmup.real_time, "memory": device_memory()}


def run_worker(args) -> int:
    """`serve`: the generator worker."""
    from characters_jax.config.arguments import config_from_args, set_argv
    from characters_jax.serving.composition import build_worker
    from characters_jax.serving.decoder_link import DecoderClient
    from characters_jax.serving.metrics import WorkerMetrics
    from characters_jax.serving.placement import GIB, apply_to_this_process, plan, visible_gpus
    from characters_jax.serving.supervisor import Supervisor

    stop = stop_on_signals()
    t_start = time.perf_counter()
    cfg = config_from_args(args)
    sv = cfg.serve
    options = sv.session
    from characters_jax.decoder.address import require_loopback
    from characters_jax.serving.tls import worker_transport

    try:
        credentials, interceptors = worker_transport(sv.tls_cert or None, sv.tls_key or None, sv.tls_client_ca or None,
                                                     sv.auth_tokens or None)
        if sv.decoder:
            require_loopback(sv.decoder, "serve.decoder")
    except ValueError as err:
        print(f"characters-jax serve: {err}", file=sys.stderr)
        return 2
    log.info("transport", extra={"fields": {"tls": credentials is not None, "client_certificates": bool(sv.tls_client_ca),
                                            "bearer_tokens": bool(interceptors)}})
    # Placement first: a plan that cannot fit is refused before anything is initialised.
    placement = plan(cfg, args.tp, visible_gpus(), decoder_device=sv.decoder_device or None,
                     decoder_memory_bytes=int(sv.decoder_memory_gib * GIB) if sv.decoder_memory_gib else None,
                     generator_memory_fraction=sv.memory_fraction or None)
    apply_to_this_process(placement.generator_env())
    from characters_jax.weights.directory import WeightsError, checkpoint_path
    from characters_jax.weights.dit import dit_checkpoint

    try:  # the weights checked against the config (after the placement: this starts JAX), before any compile
        path = checkpoint_path(args.checkpoint, cfg.name)
        dit_path = dit_checkpoint(path, cfg) if path else None
        checkpoint = str(path.resolve()) if path else None
    except (WeightsError, FileNotFoundError) as err:
        print(f"characters-jax serve: --checkpoint: {err}", file=sys.stderr)
        return 2
    log.info("placement", extra={"fields": {"placement": placement.summary}})
    metrics = WorkerMetrics()
    metrics.count_compiles()
    state: dict = {"pid": os.getpid(), "config": cfg.name, "placement": placement.summary}

    state["compile_cache"] = _use_compile_cache(sv.compile_cache)
    supervisor = None
    tmpdir = None
    decoder_state = None
    if sv.decoder:
        decoder_address = sv.decoder
    else:
        tmpdir = tempfile.TemporaryDirectory(prefix="characters-decoder-")
        decoder_address = f"unix:{tmpdir.name}/decoder.sock"
        decoder_state = pathlib.Path(tmpdir.name) / "decoder.json"
        argv = [sys.executable, "-m", "characters_jax.cli", "decode-serve", "--config", args.config, "--listen", decoder_address,
                "--state-file", str(decoder_state), "--checkpoint", checkpoint or "none", *set_argv(args.set)]

        def on_start(pid, restarts):
            state.update(decoder_pid=pid, decoder_restarts=restarts)
            metrics.decoder_started(restarts)
            if state.get("port"):
                write_state_file(args.state_file, state)

        cache_env = {"JAX_COMPILATION_CACHE_DIR": state["compile_cache"]} if state["compile_cache"] else {}
        supervisor = Supervisor("decoder", argv, env=child_env(1, {**placement.decoder_env(), **cache_env}), on_start=on_start)
        supervisor.start()
    state["decoder_address"] = decoder_address

    from characters_jax.engine.generator import DiTGenerator
    from characters_jax.serving.placement import PlacementError

    state["checkpoint"] = checkpoint or "random weights"
    try:  # compiled before any weight is placed; a plan that cannot fit is refused here
        programs, state["memory_plan"], compile_s = _compile_generator(cfg, args.tp, dit_path is None, placement)
    except PlacementError:
        if supervisor is not None:
            supervisor.stop()
        raise
    log.info("memory plan", extra={"fields": {"memory_plan": state["memory_plan"], "compile_s": round(compile_s, 2)}})
    generator = DiTGenerator(cfg, tp=args.tp, checkpoint=dit_path, seed=cfg.seed, programs=programs)
    decoder = DecoderClient(decoder_address, cfg)
    metrics.watch_decoder(decoder.channel)
    worker = build_worker(generator, decoder, options, host=args.host, port=args.port, limits=sv.rpc, credentials=credentials,
                          interceptors=interceptors, metrics=metrics, timed_steps=3)
    state["warmup"] = warmup_fields(worker.warmup, compile_s)
    log.info("generator compiled", extra={"fields": state["warmup"]})
    port = worker.port
    if port == 0:
        log.error("could not bind", extra={"fields": {"host": args.host, "port": args.port}})
        return 1
    from characters_jax.serving.liveness import GrpcLiveness

    liveness = GrpcLiveness(worker.probe_target, worker.limits.liveness_timeout_s)  # /healthz: the gRPC server answers
    metrics_host = sv.metrics_host or args.host
    metrics_http = metrics.serve_http(sv.metrics_port, metrics_host, liveness) if sv.metrics_port >= 0 else None
    metrics_port = metrics_http.port if metrics_http is not None else None

    log.info("waiting for the decoder", extra={"fields": {"decoder": decoder_address}})
    while not decoder.wait_ready(1.0):
        if stop.is_set():
            return 0
        if supervisor is not None and supervisor.refused:
            print("characters-jax serve: the decoder process refused to start (its error is in this log above)",
                  file=sys.stderr)
            return 1
    if decoder_state is not None and decoder_state.exists():
        decoder_memory = json.loads(decoder_state.read_text()).get("memory", {})
        state["decoder_memory"] = decoder_memory
        metrics.set_device_memory({f"decoder_{k}": v for k, v in decoder_memory.items()})
    worker.start()
    state.update(port=port, metrics_port=metrics_port, metrics_host=metrics_host, worker_id=worker.options.worker_id)
    warm = state["warmup"]
    state["startup_s"] = round(time.perf_counter() - t_start, 2)
    write_state_file(args.state_file, state)
    log.info("worker ready", extra={"fields": {"port": port, "metrics_port": metrics_port, "config": cfg.name, "tp": args.tp, "startup_s": state["startup_s"], "step_ms": warm["step_ms"], "checkpoint": state["checkpoint"]}})
    if not warm["real_time"]:
        log.warning("not real time on this hardware", extra={"fields": {
            "step_ms": warm["step_ms"], "budget_ms": round(cfg.video.step_seconds * 1e3, 1), "fps_capacity": warm["fps_capacity"],
            "note": "sessions stream at this rate, below the video's fps: playout will stall"}})

    stop.wait()
    from characters_jax.serving.shutdown import SLACK_S, exit_after

    exit_after(options.drain_timeout_s + SLACK_S)  # whatever a stream does, the process ends
    log.info("draining", extra={"fields": {"drain_timeout_s": options.drain_timeout_s}})
    outcome = worker.drain()
    log.info("drained", extra={"fields": {"outcome": outcome}})
    worker.stop(grace=3)
    if supervisor is not None:
        supervisor.stop()
    metrics.unwatch_decoder()
    decoder.close()
    liveness.close()
    if metrics_http is not None:
        metrics_http.close()
    if tmpdir is not None:
        tmpdir.cleanup()
    log.info("worker stopped")
    return 0
