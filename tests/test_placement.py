"""Device placement of a worker: plans on described machines, and `serve` refusing a plan
that cannot fit within seconds, before any initialisation (GPUs described by a stand-in
`nvidia-smi` on PATH)."""

import os
import stat
import subprocess
import sys
import time

import pytest

from characters_jax.config import ConfigError, load_config
from characters_jax.serving import placement as pl
from characters_jax.processes import child_env

MIB = 1 << 20
GIB = 1 << 30
H200 = ("NVIDIA H200", 143771)
H100 = ("NVIDIA H100 80GB HBM3", 81559)
L40S = ("NVIDIA L40S", 46068)
C57 = load_config("characters-57b")


def gpus(kind, n, used_mib=500):
    name, total = kind
    return [pl.Gpu(i, f"GPU-{i:08d}-aaaa", name, total * MIB, used_mib * MIB) for i in range(n)]


def test_one_h200_shares_the_gpu_with_explicit_budgets():
    p = pl.plan(C57, 1, gpus(H200, 1))
    assert p.platform == "gpu" and p.decoder_shares_gpu
    need = pl.generator_need(C57, 1)
    total = H200[1] * MIB
    # Both pools and both reserves fit the card, and the generator's pool holds its need.
    assert p.generator_fraction * total >= need.total
    assert (p.generator_fraction + p.decoder_fraction) * total + 2 * pl.PROCESS_RESERVE_BYTES <= total
    env = p.generator_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-00000000-aaaa"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{p.generator_fraction:.3f}" and env["JAX_PLATFORMS"] == "cuda"
    assert "XLA_CLIENT_MEM_FRACTION" not in env  # both spellings at once: the CUDA plugin refuses
    assert p.decoder_env()["CUDA_VISIBLE_DEVICES"] == "GPU-00000000-aaaa"
    assert float(p.decoder_env()["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == p.decoder_fraction


def test_a_spare_gpu_goes_to_the_decoder():
    p = pl.plan(C57, 2, gpus(H200, 3))
    assert p.generator_devices == ("GPU-00000000-aaaa", "GPU-00000001-aaaa")
    assert p.decoder_device == "GPU-00000002-aaaa" and not p.decoder_shares_gpu
    assert pl.plan(C57, 4, gpus(H200, 4)).decoder_device == "GPU-00000000-aaaa"  # none spare: shares
    assert pl.plan(C57, 1, gpus(H200, 2), decoder_device="0").decoder_shares_gpu
    cpu = pl.plan(load_config("small"), 1, gpus(H200, 1), decoder_device="cpu")
    assert cpu.decoder_env() == {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}


def test_more_tp_than_gpus_is_refused_with_what_fits():
    with pytest.raises(pl.PlacementError, match=r"--tp 4 needs 4 GPUs; 2 visible .*sizes that this machine has GPUs for: 1, 2"):
        pl.plan(C57, 4, gpus(H200, 2))


def test_one_h100_holds_57b_at_tp1_beside_its_decoder():
    p = pl.plan(C57, 1, gpus(H100, 1))
    assert p.decoder_shares_gpu and p.decoder_on == "shared"
    total = H100[1] * MIB
    pool = p.generator_fraction * total
    # Parameters + KV cache (~59.1 GiB) and the reserve in the pool fit, with room to spare
    # for the measured working memory; both pools and both outside reserves fit the card.
    assert pool >= p.need.total + pl.POOL_RESERVE_BYTES + 5 * GIB, pool / GIB
    assert (p.generator_fraction + p.decoder_fraction) * total + 2 * pl.PROCESS_RESERVE_BYTES <= total
    assert p.decoder_bytes == pl.decoder_need(C57) + pl.DECODER_SCRATCH_BYTES + pl.PROCESS_RESERVE_BYTES


def test_a_config_that_does_not_fit_names_its_need_and_what_would():
    with pytest.raises(pl.PlacementError) as err:
        pl.plan(C57, 1, gpus(L40S, 1))
    msg = str(err.value)
    assert "needs more than ~" in msg and "parameters 53.2 GiB" in msg and "at least 2 such GPUs" in msg, msg
    # Memory other processes hold counts: a busy H100 is refused too.
    with pytest.raises(pl.PlacementError, match="in use"):
        pl.plan(C57, 1, gpus(H100, 1, used_mib=20_000))
    with pytest.raises(pl.PlacementError, match="not a visible GPU"):
        pl.plan(C57, 1, gpus(H200, 1), decoder_device="7")
    with pytest.raises(ConfigError, match="num_heads"):
        pl.plan(C57, 5, gpus(H200, 8))


def test_the_measured_working_memory_is_checked_against_the_pool():
    p = pl.plan(C57, 1, gpus(H100, 1))
    pool = int(p.generator_fraction * H100[1] * MIB)
    need = pl.check_measured(C57, p, p.need.params, p.need.cache, int(0.1 * GIB), pool)
    assert need.measured and need.working == int(0.1 * GIB) + pl.POOL_RESERVE_BYTES
    line = pl.memory_plan_line(p, need, pool)
    for part in ("parameters 53.2 GiB", "KV cache 6.0 GiB", "working memory 0.60 GiB (measured)", "to spare",
                 "the decoder's share ~", "generator's first GPU"):
        assert part in line, line
    # A working memory that does not fit is refused, saying what would fit.
    with pytest.raises(pl.PlacementError) as err:
        pl.check_measured(C57, p, p.need.params, p.need.cache, 14 * GIB, pool)
    assert "working memory 14.5 GiB (measured)" in str(err.value) and "at least 2 such GPUs" in str(err.value), str(err.value)


def test_working_memory_of_the_compiled_programs():
    from characters_jax.engine.generator import GeneratorMemory, ProgramMemory

    m = GeneratorMemory(params=100, state=10, programs={
        "init_params": ProgramMemory(temp=40, code=1, new_outputs=100),  # its output is the parameters
        "init_state": ProgramMemory(temp=0, code=1, new_outputs=10),
        "step": ProgramMemory(temp=30, code=2, new_outputs=3),  # the latent
        "prefill_8": ProgramMemory(temp=50, code=2, new_outputs=0)})
    assert m.working == 50 + (1 + 1 + 2 + 2) + 3
    assert m.largest_temp() == ("prefill_8", 50)


def test_the_benchmarks_pool_keeps_a_fraction_the_environment_sets(monkeypatch):
    for name in pl.FRACTION_NAMES:
        monkeypatch.delenv(name, raising=False)
    p = pl.plan(C57, 1, gpus(H100, 1), with_decoder=False)
    assert p.decoder_on == "none" and not p.decoder_bytes
    assert p.pool_env() == {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{p.generator_fraction:.3f}"}
    # Without a decoder the generator takes the GPU's free memory less its reserve.
    assert p.generator_fraction == round(((H100[1] - 500) * MIB - pl.PROCESS_RESERVE_BYTES) / (H100[1] * MIB), 3)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    assert p.pool_env() == {}


def test_a_cpu_host_without_the_memory_is_refused_with_what_fits():
    small_host = pl.HostMemory(available=20 * GIB, total=24 * GIB)
    with pytest.raises(pl.PlacementError) as err:
        pl.plan(C57, 8, [], host=small_host)
    msg = str(err.value)
    assert "host memory" in msg and "20.0 GiB available of 24.0 GiB" in msg, msg
    assert "configs that fit this host: small, talking, tiny" in msg, msg
    # Negative controls: a host with the memory, and a small config on the small host.
    big = pl.plan(C57, 8, [], host=pl.HostMemory(available=600 * GIB, total=640 * GIB))
    assert big.platform == "cpu" and big.need.params * 8 > 53 * GIB
    assert pl.plan(load_config("tiny"), 2, [], host=small_host).platform == "cpu"


def test_needs_follow_the_shapes():
    one, four = pl.generator_need(C57, 1), pl.generator_need(C57, 4)
    assert 53 * (1 << 30) < one.params < 54 * (1 << 30)  # ~57B parameters, FP8 blocks
    # Replicated: embeddings, heads and the shared adaLN MLP (~1 GiB), a few percent.
    assert 0 < four.params * 4 - one.params < 0.06 * one.params
    assert abs(four.cache * 4 - one.cache) < 0.001 * one.cache  # K/V over heads; slot masks replicated
    assert pl.decoder_need(C57) > 10 * pl.decoder_need(load_config("small"))


def test_cpu_plan_gives_the_generator_enough_host_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    p = pl.plan(load_config("tiny"), 2, [])
    assert p.platform == "cpu"
    assert p.generator_env() == {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert pl.plan(load_config("tiny"), 2, []).generator_env() == {}
    with pytest.raises(pl.PlacementError, match="no GPU is visible"):
        pl.plan(load_config("tiny"), 1, [], decoder_device="0")


def fake_smi(tmp_path, kind, n):
    """A stand-in nvidia-smi answering the inventory query for n GPUs of `kind`."""
    name, total = kind
    rows = "\\n".join(f"{i}, GPU-{i:08d}-aaaa, {name}, {total}, 500" for i in range(n))
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\nprintf '{rows}\\n'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_visible_gpus_honours_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path, H200, 4)}:{os.environ['PATH']}")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g.index for g in pl.visible_gpus()] == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-00000000")
    assert [g.index for g in pl.visible_gpus()] == [2, 0]
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert pl.visible_gpus() == []


@pytest.mark.parametrize("kind, n, args, expect", [
    (H200, 1, ["--tp", "2"], "--tp 2 needs 2 GPUs; 1 visible"),
    (L40S, 1, [], "at least 2 such GPUs"),
])
def test_serve_refuses_a_plan_that_cannot_fit_within_seconds(tmp_path, kind, n, args, expect):
    env = child_env(1, {"PATH": f"{fake_smi(tmp_path, kind, n)}:{os.environ['PATH']}"})
    env.pop("JAX_PLATFORMS", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "characters_jax.cli", "serve", "--config", "characters-57b", "--port", "0",
                        "--set", "serve.metrics_port=-1", *args], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-2000:]
    assert expect in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert elapsed < 60, f"refused after {elapsed:.1f} s"


def test_serve_on_a_cpu_host_without_the_memory_is_refused_within_seconds():
    need = pl.plan(C57, 8, [], host=pl.HostMemory(1 << 50, 1 << 50)).need
    if pl.host_memory().available > 8 * need.total:
        pytest.skip("this host has the memory for characters-57b at tp=8 on the CPU")
    env = child_env(1, {"JAX_PLATFORMS": "cpu"})
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "characters_jax.cli", "serve", "--config", "characters-57b", "--tp", "8",
                        "--port", "0", "--set", "serve.metrics_port=-1"], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-2000:]
    assert "of host memory" in r.stderr and "configs that fit this host" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "decoder" not in r.stdout, r.stderr[-2000:]
    assert elapsed < 60, f"refused after {elapsed:.1f} s"


def test_a_session_at_tp2_on_the_cpu_mesh(tmp_path):
    """The sharded generator (2 host devices standing in for 2 GPUs) behind the service."""
    from characters_jax.protos_gen import characters_pb2 as pb
    from serving_harness import Worker, png, speech

    w = Worker(tmp_path, "tiny", args=("--tp", "2"), env=child_env(1))
    try:
        assert "generator on 2 host device(s)" in w.state()["placement"]
        s = w.client.create_session(png(), prompt="two devices", seed=2)
        pcm = speech(0.5)
        res = w.client.converse(s.session_id, pcm, realtime=False)
    finally:
        w.stop()
    assert res.final_event.state == pb.COMPLETED and len(res.chunks) == 3
    assert all(c.width == 128 and len(c.frames) == 4 for c in res.chunks)
