"""Process entry points: the generator worker (`serve`) and the decoder (`decode-serve`).

The worker: loads the config and the generator, starts (and supervises) its decoder process
unless given one, compiles everything once, then serves CharacterService + grpc.health.v1 +
reflection on one port and Prometheus metrics on another. It writes a small JSON state file
(ports, pids) when ready. SIGTERM (or SIGINT) ends the live session as CANCELLED, then stops.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time
from concurrent import futures

import grpc

from characters_jax.serving.placement import host_device_flags

log = logging.getLogger("characters_jax.serving.server")

SERVICE_NAME = "characters.v1.CharacterService"
SERVER_OPTIONS = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20), ("grpc.so_reuseport", 0)]


def child_env(device_count: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with its own XLA host device count, plus `extra`."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = host_device_flags(env.get("XLA_FLAGS", ""), device_count)
    env.update(extra or {})
    return env


def _write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    tmp = pathlib.Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _wait_for_stop() -> threading.Event:
    stop = threading.Event()

    def handler(signum, _frame):
        log.info("signal received", extra={"fields": {"signal": signal.Signals(signum).name}})
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def run_decoder(args) -> int:
    """`decode-serve`: compile, then serve DecoderService until SIGTERM."""
    from characters_jax.config import load_config
    from characters_jax.decoder.runtime import VaeRuntime
    from characters_jax.decoder.service import start_decoder_server

    stop = _wait_for_stop()
    cfg = load_config(args.config)
    t0 = time.perf_counter()
    rt = VaeRuntime(cfg, seed=args.seed)
    rt.warmup()
    server, port = start_decoder_server(rt, args.listen)
    if port == 0:
        log.error("could not bind", extra={"fields": {"listen": args.listen}})
        return 1
    import jax

    from characters_jax.serving.metrics import device_memory

    memory = device_memory()
    log.info("decoder ready", extra={"fields": {"listen": args.listen, "port": port, "config": cfg.name, "device": str(jax.devices()[0]), "startup_s": round(time.perf_counter() - t0, 2), **memory}})
    _write_json(args.state_file, {"port": port, "pid": os.getpid(), "device": str(jax.devices()[0]), "memory": memory})
    stop.wait()
    server.stop(grace=1).wait()
    log.info("decoder stopped")
    return 0


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


def _compile_concurrently(generator, tokens) -> None:
    """Compiles the prefill of every prompt bucket and the step at once, one thread each
    (XLA compiles outside the GIL), ahead of their first call, which then finds them
    compiled. tokens: one step's audio tokens."""
    import jax.numpy as jnp

    e, cfg = generator.engine, generator.config
    latent = jnp.zeros((cfg.video.tokens_per_frame, cfg.model.latent_channels), jnp.float32)
    jobs = [functools.partial(e.prefill.lower, generator.params, generator.state, latent, jnp.zeros((b,), jnp.int32),
                              jnp.int32(1), jnp.uint32(0)) for b in cfg.cache.prompt_buckets]
    jobs.append(functools.partial(e.step.lower, generator.params, generator.state, tokens))
    with futures.ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="compile") as pool:
        for done in [pool.submit(lambda lower: lower().compile(), job) for job in jobs]:
            done.result()


def _warmup(generator, frontend, cfg, metrics, timed_steps: int = 3) -> dict:
    """Compiles the prefill of every prompt bucket and the step, so sessions never compile,
    then times `timed_steps` more steps (the worker's honest speed, logged at start-up).
    Returns {compile_s, step_ms (median), fps_capacity, real_time, memory}."""
    import numpy as np

    from characters_jax.serving.metrics import device_memory

    v, m = cfg.video, cfg.model
    t0 = time.perf_counter()
    tokens = frontend.tokens(np.zeros(frontend.spec.window_samples, np.float32))
    _compile_concurrently(generator, tokens)
    latent = np.zeros((v.grid_h, v.grid_w, m.latent_channels), np.float32)
    for n in cfg.cache.prompt_buckets:  # the compiled programs, run once each
        generator.start_session(latent, [32] * n, 0)
    generator.step(tokens).block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(timed_steps):
        t = time.perf_counter()
        generator.step(tokens).block_until_ready()
        times.append(time.perf_counter() - t)
    metrics.refresh_device_stats(generator)
    step_ms = float(np.median(times)) * 1e3
    fps = v.frames_per_step / (step_ms / 1e3)
    return {"compile_s": round(compile_s, 2), "step_ms": round(step_ms, 2), "fps_capacity": round(fps, 1),
            "real_time": bool(step_ms <= v.step_seconds * 1e3), "memory": device_memory()}


def run_worker(args) -> int:
    """`serve`: the generator worker."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from characters_jax.audio.features import AudioFrontEnd
    from characters_jax.audio.timeline import Timeline
    from characters_jax.config import load_config
    from characters_jax.protos_gen import characters_pb2, characters_pb2_grpc
    from characters_jax.serving.decoder_link import DecoderClient
    from characters_jax.serving.images import ImageLimits
    from characters_jax.serving.metrics import WorkerMetrics
    from characters_jax.serving.placement import GIB, apply_to_this_process, plan, visible_gpus
    from characters_jax.serving.session import SessionTable
    from characters_jax.serving.supervisor import Supervisor
    from characters_jax.serving.worker import CharacterServicer, WorkerContext, WorkerOptions

    stop = _wait_for_stop()
    t_start = time.perf_counter()
    cfg = load_config(args.config)
    # Placement first: a plan that cannot fit is refused before anything is initialised.
    placement = plan(cfg, args.tp, visible_gpus(), decoder_device=args.decoder_device,
                     decoder_memory_bytes=None if args.decoder_memory_gib is None else int(args.decoder_memory_gib * GIB),
                     generator_memory_fraction=args.memory_fraction)
    apply_to_this_process(placement.generator_env())
    log.info("placement", extra={"fields": {"placement": placement.summary}})
    metrics = WorkerMetrics()
    metrics.count_compiles()
    state: dict = {"pid": os.getpid(), "config": cfg.name, "placement": placement.summary}

    state["compile_cache"] = _use_compile_cache(args.compile_cache)
    supervisor = None
    tmpdir = None
    decoder_state = None
    if args.decoder:
        decoder_address = args.decoder
    else:
        tmpdir = tempfile.TemporaryDirectory(prefix="characters-decoder-")
        decoder_address = f"unix:{tmpdir.name}/decoder.sock"
        decoder_state = pathlib.Path(tmpdir.name) / "decoder.json"
        argv = [sys.executable, "-m", "characters_jax.cli", "decode-serve", "--config", args.config, "--listen", decoder_address,
                "--seed", str(args.seed), "--state-file", str(decoder_state)]

        def on_start(pid, restarts):
            state.update(decoder_pid=pid, decoder_restarts=restarts)
            if state.get("port"):
                _write_json(args.state_file, state)

        cache_env = {"JAX_COMPILATION_CACHE_DIR": state["compile_cache"]} if state["compile_cache"] else {}
        supervisor = Supervisor("decoder", argv, env=child_env(1, {**placement.decoder_env(), **cache_env}), on_start=on_start)
        supervisor.start()
    state["decoder_address"] = decoder_address

    from characters_jax.engine.generator import DiTGenerator

    generator = DiTGenerator(cfg, tp=args.tp, checkpoint=args.checkpoint, seed=args.seed)
    frontend = AudioFrontEnd(cfg)
    state["warmup"] = _warmup(generator, frontend, cfg, metrics)
    log.info("generator compiled", extra={"fields": state["warmup"]})
    decoder = DecoderClient(decoder_address)
    ctx = WorkerContext(cfg, generator, threading.Lock(), frontend, Timeline.from_config(cfg), decoder, metrics)

    health_servicer = health.HealthServicer()

    def on_change(rec, old, idle):
        metrics.set_state(old, rec.state)
        if not servicer.shutting_down.is_set():
            health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if idle else health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("session state", extra={"fields": {"session_id": rec.session_id, "from": old, "to": rec.state, "code": rec.status_code.name, "reason": rec.status_message}})

    options = WorkerOptions(lead_chunks=args.lead_chunks, ready_timeout_s=args.ready_timeout, audio_timeout_s=args.audio_timeout, image_limits=ImageLimits(max_bytes=args.max_image_bytes))
    servicer = CharacterServicer(ctx, options, SessionTable(on_change))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=SERVER_OPTIONS)
    characters_pb2_grpc.add_CharacterServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (characters_pb2.DESCRIPTOR.services_by_name["CharacterService"].full_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        log.error("could not bind", extra={"fields": {"host": args.host, "port": args.port}})
        return 1
    metrics_port = metrics.serve_http(args.metrics_port) if args.metrics_port >= 0 else None

    log.info("waiting for the decoder", extra={"fields": {"decoder": decoder_address}})
    while not decoder.wait_ready(1.0):
        if stop.is_set():
            return 0
    if decoder_state is not None and decoder_state.exists():
        decoder_memory = json.loads(decoder_state.read_text()).get("memory", {})
        state["decoder_memory"] = decoder_memory
        metrics.set_device_memory({f"decoder_{k}": v for k, v in decoder_memory.items()})
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    server.start()
    state.update(port=port, metrics_port=metrics_port)
    warm = state["warmup"]
    state["startup_s"] = round(time.perf_counter() - t_start, 2)
    _write_json(args.state_file, state)
    log.info("worker ready", extra={"fields": {"port": port, "metrics_port": metrics_port, "config": cfg.name, "tp": args.tp, "startup_s": state["startup_s"], "step_ms": warm["step_ms"], "checkpoint": args.checkpoint or "random weights"}})
    if not warm["real_time"]:
        log.warning("not real time on this hardware", extra={"fields": {
            "step_ms": warm["step_ms"], "budget_ms": round(cfg.video.step_seconds * 1e3, 1), "fps_capacity": warm["fps_capacity"],
            "note": "sessions stream at this rate, below the video's fps: playout will stall"}})

    stop.wait()
    log.info("shutting down")
    servicer.shutdown()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=3).wait()
    if supervisor is not None:
        supervisor.stop()
    decoder.close()
    if tmpdir is not None:
        tmpdir.cleanup()
    log.info("worker stopped")
    return 0
