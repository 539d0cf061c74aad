"""One config surface: one TOML loader for every table (model configs, training settings,
the commands' options), `--set TABLE.KEY=VALUE` on every command that has options to set,
the [serve] table's defaults in one place, and a budget on the command line's flags."""

import argparse
import dataclasses
import pathlib
import subprocess
import sys

import pytest

from characters_jax.cli import build_parser, main
from characters_jax.config import BenchConfig, ConfigError, ImageLimits, RpcLimits, ServeConfig, WorkerOptions, load_config
from characters_jax.config.arguments import config_from_args, config_sets, set_argv
from characters_jax.config.loader import apply_sets, from_document, parse_set, table_keys, with_sets
from characters_jax.processes import child_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Option flags of every leaf command together, the gate's included.
FLAG_BUDGET = 100
# Flags that --set replaces.
ENGINE_FLAGS = {"--attention", "--reduce", "--kernels", "--cache-mode", "--cache-dtype"}
RETIRED = ENGINE_FLAGS | {"--drain-timeout", "--metrics-port", "--tls-cert", "--auth-tokens", "--max-duration", "--idle-timeout",
                          "--lead-chunks", "--seed", "--warmup", "--deadline-s", "--startup-timeout"}


def _leaves(parser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), parser
    for a in subs:
        for name, sub in a.choices.items():
            yield from _leaves(sub, (*path, name))


def _flags(parser) -> list[str]:
    return [a.option_strings[-1] for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "custom.toml"
    path.write_text(text)
    return str(path)


# -- the loader ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("[nosuch]\nx = 1\n", "nosuch: unknown table or key"),
    ("[serve]\ndrain_timeout = 1.0\n", "serve.drain_timeout: unknown key"),
    ('[serve]\nlead_chunks = "3"\n', "serve.lead_chunks: expected int"),
    ("[serve]\nlead_chunks = 1.5\n", "serve.lead_chunks: expected int"),
    ("[serve]\nlead_chunks = 0\n", "serve.lead_chunks: must be >= 1"),
    ("[serve]\nimage_max_bytes = 0\n", "serve.image_max_bytes: must be >= 1"),
    ("[serve]\nmax_character_rpcs = 0\n", "serve.max_character_rpcs: must be >= 1"),
    ("[serve]\ntls_cert = 3\n", "serve.tls_cert: expected str"),
    ("[bench]\nquiet = 1\n", "bench.quiet: expected true or false"),
    ("[cache]\nprompt_buckets = [8, 16.5]\n", r"cache.prompt_buckets\[1\]: expected int"),
    ('seed = "one"\n', "seed: expected int"),
    ("serve = 3\n", "serve: expected a table"),
    ("[model\n", "not valid TOML"),
])
def test_a_bad_table_key_or_value_is_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace(r"\.\[", r"\[")):
        load_config(_write(tmp_path, text))


def test_a_config_file_may_carry_serve_and_bench_tables(tmp_path):
    cfg = load_config(_write(tmp_path, '[serve]\ndrain_timeout_s = 30\nmax_reflection_streams = 2\nimage_max_pixels = 1024\n'
                                       'metrics_host = "127.0.0.3"\n[bench]\nwarmup = 1\n'))
    assert cfg.serve.session == WorkerOptions(drain_timeout_s=30.0, image_limits=ImageLimits(max_pixels=1024))
    assert cfg.serve.rpc == RpcLimits(max_reflection_streams=2)
    assert cfg.serve.metrics_host == "127.0.0.3" and cfg.bench == BenchConfig(warmup=1)
    assert isinstance(cfg.serve.session.drain_timeout_s, float)  # an int where a float goes becomes a float


def test_set_values_are_toml_else_text_and_the_last_wins():
    assert parse_set("dit.lr=1e-3")[1].value == 1e-3 and parse_set("vae.batch=8")[1].value == 8
    assert parse_set("cache.prompt_buckets=[8, 16]")[1].value == [8, 16] and parse_set("seed=3")[0] == ("seed",)
    cfg = load_config("tiny", ["engine.kernels=gemm+qkv", "serve.decoder_device=0", "serve.worker_id=7",
                               "serve.tls_cert=/etc/pki/w.pem", "serve.drain_timeout_s=5", "serve.drain_timeout_s=6",
                               "cache.prompt_buckets=[8, 16, 32]", "bench.quiet=true", "seed=3"])
    # a key whose default is a string takes the text as written (a GPU index, a name of digits)
    assert (cfg.serve.decoder_device, cfg.serve.session.worker_id) == ("0", "7")
    assert cfg.engine.kernels == "gemm+qkv" and cfg.serve.tls_cert == "/etc/pki/w.pem"
    assert cfg.serve.session.drain_timeout_s == 6.0 and cfg.cache.prompt_buckets == (8, 16, 32)
    assert cfg.bench.quiet is True and cfg.seed == 3
    for item, message in (("serve.tls_cert", "expected TABLE.KEY=VALUE"), ("a.b.c=1", "expected TABLE.KEY=VALUE"),
                          ("name.x=1", "name is a key, not a table"), ("serve.lead_chunks=three", "serve.lead_chunks: expected int")):
        with pytest.raises(ConfigError, match=message):
            load_config("tiny", [item])
    assert apply_sets({"serve": {"lead_chunks": 2}}, []) == {"serve": {"lead_chunks": 2}}


def test_nested_options_sit_beside_the_tables_own_keys():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        rate: float = 1.0

    @dataclasses.dataclass(frozen=True)
    class Table:
        size: int = 2
        inner: Inner = Inner()
        other: Inner = dataclasses.field(default=Inner(), metadata={"prefix": "other_"})

    @dataclasses.dataclass(frozen=True)
    class Root:
        seed: int = 0
        table: Table = Table()

    assert table_keys(Table()) == {"size": ("size",), "rate": ("inner", "rate"), "other_rate": ("other", "rate")}
    out = from_document(Root(), {"seed": 4, "table": {"rate": 3, "other_rate": 0.5}})
    assert out == Root(4, Table(inner=Inner(3.0), other=Inner(0.5)))

    @dataclasses.dataclass(frozen=True)
    class Clash:
        rate: float = 0.0
        inner: Inner = Inner()

    with pytest.raises(TypeError, match="rate"):
        table_keys(Clash())


def test_training_settings_read_through_the_same_loader():
    from characters_jax.train.settings import load_settings

    s = load_settings("cpu-smoke", ["vae.lr=0.01", "budget.deadline_s=60", "seed=2"])
    assert (s.vae.optim.lr, s.budget.deadline_s, s.seed) == (0.01, 60.0, 2)
    with pytest.raises(ConfigError, match=r"budget\.deadline_s: expected float"):
        load_settings("cpu-smoke", ["budget.deadline_s=soon"])


def test_options_of_a_command_without_a_file():
    from characters_jax.client.talk import TalkOptions

    assert with_sets(TalkOptions(), "talk", ["talk.fast=true", "talk.open_timeout_s=10"]) == TalkOptions(fast=True, open_timeout_s=10.0)
    for items, message in ((["serve.fast=true"], "serve: unknown table"), (["talk.fast=yes"], "talk.fast: expected true or false"),
                           (["talk.open_timeout_s=0"], "talk.open_timeout_s: must be > 0")):
        with pytest.raises(ConfigError, match=message):
            with_sets(TalkOptions(), "talk", items)


# -- the [serve] table: defaults in one place -------------------------------------------------------
def test_serve_builds_the_worker_options_from_the_serve_table_alone():
    """`serve` with no --set builds WorkerOptions() and RpcLimits(): no default of the [serve]
    table is written again on the command line (no flag of serve sets one of its keys)."""
    import characters_jax.serving.admission as admission
    import characters_jax.serving.worker as worker
    import characters_jax.wire.images as images

    assert (worker.WorkerOptions, admission.RpcLimits, images.ImageLimits) == (WorkerOptions, RpcLimits, ImageLimits)
    parser = build_parser()
    for name in ("tiny", "small", "talking", "characters-57b"):
        cfg = config_from_args(parser.parse_args(["serve", "--config", name]))
        assert cfg.serve == ServeConfig() and cfg.serve.session == WorkerOptions() and cfg.serve.rpc == RpcLimits()
    cfg = config_from_args(parser.parse_args(["serve", "--set", "serve.drain_timeout_s=30", "--set", "serve.max_character_rpcs=2"]))
    assert cfg.serve.session == dataclasses.replace(WorkerOptions(), drain_timeout_s=30.0)
    assert cfg.serve.rpc == dataclasses.replace(RpcLimits(), max_character_rpcs=2)
    keys = set(table_keys(ServeConfig()))
    assert {"drain_timeout_s", "lead_chunks", "image_max_bytes", "max_character_rpcs", "metrics_port", "tls_cert"} <= keys
    for command in ("serve", "demo", "view", "decode-serve"):
        leaf = dict(_leaves(parser))[command]
        dests = {a.dest for a in leaf._actions}
        assert not dests & keys, (command, dests & keys)


def test_the_readme_documents_every_key():
    """Every key of [serve], [bench] and the model's tables is in the README's tables."""
    readme = (ROOT / "README.md").read_text()
    cfg = load_config("tiny")
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        keys = table_keys(value) if dataclasses.is_dataclass(value) else {f.name: ()}
        missing = [k for k in keys if f"`{k}`" not in readme]
        assert not missing, (f.name, missing)


# -- --set on each kind of command ----------------------------------------------------------------
def test_every_command_that_has_options_takes_set_and_no_retired_flag():
    for path, leaf in _leaves(build_parser()):
        flags = set(_flags(leaf))
        assert not flags & RETIRED, (path, flags & RETIRED)
        if path != "lipsync score":
            assert "--set" in flags, path


@pytest.mark.parametrize("argv, message", [
    (["bench", "--config", "tiny", "--set", "engine.attention=flash"], "engine.attention"),  # a model config key
    (["bench", "--config", "tiny", "--set", "bench.warmup=-1"], "bench.warmup: must be >= 0"),
    (["init-checkpoint", "--config", "tiny", "--out", "/nonexistent/x", "--set", "seed=x"], "seed: expected int"),
    (["train", "eval", "--weights", "w", "--out", "o", "--set", "dit.bogus=1"], "dit.bogus: unknown key"),  # a settings key
    (["train", "eval", "--weights", "w", "--out", "o", "--set", "cache.mode=fast"], "cache.mode"),  # the model's, via train
    (["talk", "--image", "i", "--audio", "a", "--out", "o", "--set", "talk.fast=maybe"], "talk.fast: expected true or false"),
    (["data", "--out", "o", "--set", "data.shards=1"], "data.shards: unknown key"),
    (["lipsync", "evaluate", "--set", "evaluate.clips=1"], "evaluate.clips: must be at least 2"),
    (["lipsync", "train-features", "--set", "features.step=1"], "features.step: unknown key"),
    (["gate", "latent", "--config", "tiny", "--set", "gate.factor=0"], "gate.factor: must be positive"),
    (["gate", "latent", "--config", "tiny", "--set", "latent.steps=many"], "latent.steps: expected int"),
])
def test_a_bad_set_item_exits_2_naming_the_key(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_bad_serve_key_before_it_starts(tmp_path):
    """A [serve] key: exit code 2, the key named, nothing started (no JAX, within seconds)."""
    r = subprocess.run([sys.executable, "-m", "characters_jax.cli", "serve", "--config", "tiny", "--port", "0",
                        "--set", "serve.drain_timeout_s=30", "--set", "serve.lead_chunks=0"],
                       env=child_env(1), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "serve.lead_chunks: must be >= 1" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "compiled" not in r.stderr


def test_a_started_command_gets_the_set_items_of_the_config():
    items = ["engine.attention=xla", "serve.drain_timeout_s=5", "view.prebuffer_chunks=3", "seed=2"]
    ours, others = config_sets(items)
    assert ours == ["engine.attention=xla", "serve.drain_timeout_s=5", "seed=2"] and others == ["view.prebuffer_chunks=3"]
    assert set_argv(ours[:2]) == ["--set", "engine.attention=xla", "--set", "serve.drain_timeout_s=5"]


# -- the flag budget ------------------------------------------------------------------------------
def test_the_command_line_stays_within_its_flag_budget():
    counts = {path: len(_flags(leaf)) for path, leaf in _leaves(build_parser())}
    print({k: v for k, v in counts.items()})
    assert len(counts) >= 18
    total = sum(counts.values())
    assert total <= FLAG_BUDGET, f"{total} option flags (budget {FLAG_BUDGET}): fold new knobs into --set"
