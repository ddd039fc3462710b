"""Config loading: precedence, CLI syntax, error messages, --help, validation, TOML round trip."""

from __future__ import annotations

import logging

import pytest

from titan_draft.config import (
    ConfigError,
    ConfigManager,
    JobConfig,
    dump_job_config,
    load_job_config,
    validate_job_config,
    write_job_config,
)


def _parse(*argv: str) -> JobConfig:
    return ConfigManager().parse_args(list(argv))


@pytest.fixture
def toml_file(tmp_path):
    def make(text: str, name: str = "job.toml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return make


# ------------------------------------------------------------------------------------------
# precedence and syntax


def test_defaults_without_arguments():
    assert _parse() == JobConfig()
    assert load_job_config([]) == JobConfig()


def test_precedence_defaults_toml_cli(toml_file):
    path = toml_file("""
[training]
steps = 7
local_batch_size = 4

[optimizer]
lr = 1e-3
""")
    cfg = _parse("--job.config_file", path, "--training.steps", "9")
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.local_batch_size == 4  # TOML beats default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.training.grad_accum_steps == JobConfig().training.grad_accum_steps  # default
    assert cfg.job.config_file == path
    # the file is read first wherever --job.config_file stands
    assert _parse("--training.steps=9", f"--job.config-file={path}").training.steps == 9


def test_cli_spellings():
    cfg = _parse("--training.local-batch-size", "3", "--training.grad_accum_steps=2",
                 "--optimizer.lr", "6e-4", "--training.max_norm", "0", "--job.description", "a b")
    assert (cfg.training.local_batch_size, cfg.training.grad_accum_steps) == (3, 2)
    assert cfg.optimizer.lr == 6e-4 and isinstance(cfg.training.max_norm, float)
    assert cfg.job.description == "a b"
    assert _parse("--lr_scheduler.warmup_steps", "-1").lr_scheduler.warmup_steps == -1


def test_bools():
    assert _parse("--compile.enable").compile.enable is True
    assert _parse("--compile.enable", "--compile.fullgraph").compile.fullgraph is True
    assert _parse("--compile.enable", "false").compile.enable is False
    assert _parse("--compile.enable=True").compile.enable is True
    assert _parse("--data.shuffle", "0").data.shuffle is False
    assert _parse("--no-data.shuffle").data.shuffle is False
    assert _parse("--compile.enable", "--training.steps", "3").training.steps == 3


def test_lists(toml_file):
    assert _parse("--target.capture_layers", "1,9,17").target.capture_layers == [1, 9, 17]
    assert _parse("--target.capture_layers=[2, 5]").target.capture_layers == [2, 5]
    assert _parse("--target.capture_layers=").target.capture_layers == []
    assert _parse("--float8.filter_fqns", "output,head").float8.filter_fqns == ["output", "head"]
    path = toml_file("[target]\ncapture_layers = [3, 4]\n[float8]\nfilter_fqns = ['lm_head']\n")
    cfg = _parse("--job.config_file", path)
    assert cfg.target.capture_layers == [3, 4] and cfg.float8.filter_fqns == ["lm_head"]


def test_model_args_toml_and_cli(toml_file):
    path = toml_file("""
[model]
flavor = "small"

[model.args]
num_anchors = 128
block_size = 16
""")
    cfg = _parse("--job.config_file", path, "--model.args.num_anchors", "256",
                 "--model.args.name", "foo", "--model.args.ratio=0.5", "--model.args.flag", "true",
                 "--model.args.layers", "[1, 2]", "--model.args.quoted", '"7"')
    assert cfg.model.flavor == "small"
    assert cfg.model.args == {"num_anchors": 256, "block_size": 16, "name": "foo", "ratio": 0.5,
                              "flag": True, "layers": [1, 2], "quoted": "7"}
    assert _parse("--model.args", "{a = 1, b = 'x'}").model.args == {"a": 1, "b": "x"}
    assert _parse("--model.args.num-anchors", "8").model.args == {"num_anchors": 8}
    # the default dict is never shared between configs
    assert JobConfig().model.args == {}


# ------------------------------------------------------------------------------------------
# errors: every one names the key and where it came from


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("argv, words", [
    (["--trainng.steps", "3"], ["trainng", "command line", "did you mean training"]),
    (["--training.stpes", "3"], ["training.stpes", "command line", "did you mean training.steps"]),
    (["--training.lr", "1"], ["training.lr", "did you mean optimizer.lr"]),
    (["--training.steps", "ten"], ["training.steps", "'ten'", "command line"]),
    (["--training.steps", "1.5"], ["training.steps", "'1.5'"]),
    (["--compile.enable=maybe"], ["compile.enable", "'maybe'", "command line"]),
    (["--target.capture_layers", "1,x"], ["target.capture_layers", "'1,x'", "command line"]),
    (["--optimizer.lr", "fast"], ["optimizer.lr", "'fast'"]),
    (["--training.steps"], ["training.steps", "missing value"]),
    (["steps"], ["'steps'", "command line"]),
    (["--training"], ["'--training'"]),
    (["--no-training.steps"], ["training.steps", "bool"]),
    (["--model.args", "7"], ["model.args", "inline table"]),
    (["--training.steps.x", "1"], ["training.steps.x", "command line"]),
])
def test_cli_errors(argv, words):
    with pytest.raises(ConfigError) as e:
        _parse(*argv)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("text, words", [
    ("[trainng]\nsteps = 3\n", ["[trainng]", "did you mean training"]),
    ("[training]\nstpes = 3\n", ["training.stpes", "did you mean training.steps"]),
    ("[training]\nsteps = 'ten'\n", ["training.steps", "'ten'", "expected int"]),
    ("[training]\nsteps = true\n", ["training.steps", "expected int"]),
    ("[compile]\nenable = 'yes'\n", ["compile.enable", "expected bool"]),
    ("[target]\ncapture_layers = [1, 'a']\n", ["target.capture_layers", "list[int]"]),
    ("[model]\nargs = 3\n", ["model.args", "expected dict"]),
    ("steps = 3\n", ["'steps'", "[section]", "did you mean training.steps"]),
    ("[training\nsteps = 3\n", ["invalid TOML"]),
])
def test_toml_errors_name_key_and_file(toml_file, text, words):
    path = toml_file(text)
    with pytest.raises(ConfigError) as e:
        _parse("--job.config_file", path)
    assert path in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_missing_toml_file(tmp_path):
    with pytest.raises(ConfigError, match="job.config_file: no such file"):
        _parse("--job.config_file", str(tmp_path / "nope.toml"))


def test_float_field_accepts_toml_int(toml_file):
    cfg = _parse("--job.config_file", toml_file("[optimizer]\nlr = 1\n"))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


# ------------------------------------------------------------------------------------------
# --help


def test_help_lists_every_key_with_docstring(capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--training.steps", "3", "--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--training.steps INT  (default: 100)" in out
    assert "Optimizer steps to train (ignored when `epochs` > 0)." in out
    # continuation lines of a multi-line docstring are kept
    assert "compiled blocks see one shape for the whole run" in out
    assert "--target.capture_layers LIST[INT]  (default: [])" in out
    assert "--model.args DICT  (default: {})" in out
    for section, fields in ConfigManager().schema.items():
        for name, f in fields.items():
            assert f"--{section}.{name} " in out
            assert f.doc, f"{section}.{name} has no docstring"
    with pytest.raises(SystemExit):
        _parse("-h")


# ------------------------------------------------------------------------------------------
# validation


def _valid(**changes) -> JobConfig:
    cfg = JobConfig()
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_default_config_is_valid_without_warnings():
    assert validate_job_config(JobConfig()) == []


def test_float8_static_shapes_needs_max_length_multiple_of_16():
    cfg = _valid(float8__enable=True, compile__enable=True, training__static_shapes=True,
                 data__max_length=1000)
    with pytest.raises(ConfigError, match=r"data.max_length = 1000 must be a multiple of 16"):
        validate_job_config(cfg)
    cfg.data.max_length = 1024
    assert validate_job_config(cfg) == []


def test_float8_max_length_error_from_command_line():
    with pytest.raises(ConfigError, match="data.max_length"):
        load_job_config(["--float8.enable", "--training.static_shapes", "--data.max_length", "100"])


def test_compile_and_float8_without_static_shapes_warn(caplog):
    with caplog.at_level(logging.WARNING):
        warnings = validate_job_config(_valid(compile__enable=True, float8__enable=True),
                                       logging.getLogger("test"))
    assert len(warnings) == 2
    assert "recompile" in warnings[0] and "compile.enable" in warnings[0]
    assert "divisible by 16" in warnings[1] and "float8.enable" in warnings[1]
    assert len([r for r in caplog.records if r.name == "test"]) == 2
    assert "slower than bf16" in validate_job_config(
        _valid(float8__enable=True, training__static_shapes=True))[0]


@pytest.mark.parametrize("key, value, words", [
    ("activation_checkpoint__mode", "selective", "activation_checkpoint.mode"),
    ("lr_scheduler__decay_type", "step", "lr_scheduler.decay_type"),
    ("optimizer__implementation", "apex", "optimizer.implementation"),
    ("parallelism__fsdp_reshard_after_forward", "sometimes", "parallelism.fsdp_reshard_after_forward"),
    ("parallelism__data_parallel_shard_degree", 0, "parallelism.data_parallel_shard_degree"),
    ("training__steps", 0, "training.steps"),
    ("training__local_batch_size", 0, "training.local_batch_size"),
    ("training__grad_accum_steps", 0, "training.grad_accum_steps"),
    ("data__max_length", 0, "data.max_length"),
    ("checkpoint__keep_latest_k", -1, "checkpoint.keep_latest_k"),
    ("training__mixed_precision_param", "fp8", "training.mixed_precision_param"),
    ("job__device", "tpu", "job.device"),
    ("target__backend", "vllm", "target.backend"),
    ("target__capture_layers", [1, 1], "target.capture_layers"),
    ("optimizer__beta2", 1.5, "optimizer.beta2"),
])
def test_validation_errors(key, value, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        validate_job_config(_valid(**{key: value}))


def test_validation_accepts_edge_values():
    validate_job_config(_valid(checkpoint__keep_latest_k=1))
    validate_job_config(_valid(checkpoint__keep_latest_k=0))
    validate_job_config(_valid(training__steps=0, training__epochs=2))


def test_validation_collects_all_errors():
    with pytest.raises(ConfigError) as e:
        validate_job_config(_valid(training__steps=0, activation_checkpoint__mode="x"))
    assert "training.steps" in str(e.value) and "activation_checkpoint.mode" in str(e.value)


# ------------------------------------------------------------------------------------------
# writing


def test_write_load_round_trip(tmp_path):
    cfg = _parse("--training.steps", "11", "--optimizer.eps", "1e-12", "--optimizer.lr", "3e-4",
                 "--target.capture_layers", "1,9,17", "--float8.filter_fqns", "out,head",
                 "--model.args.num_anchors", "256", "--model.args.nested", "{a = [1, 2], 'b c' = 'd'}",
                 "--model.args.weird key", "1", "--no-data.shuffle")
    cfg.job.description = 'quotes " and \\ backslash\nnew line\ttab \x01 ünïcode'
    cfg.data.system_prompt = "it's"
    path = write_job_config(cfg, tmp_path / "sub" / "config.toml")
    loaded = _parse("--job.config_file", str(path))
    assert loaded.job.config_file == str(path)
    loaded.job.config_file = cfg.job.config_file
    assert loaded == cfg
    # and the defaults survive as well
    write_job_config(JobConfig(), tmp_path / "d.toml")
    loaded = _parse("--job.config_file", str(tmp_path / "d.toml"))
    loaded.job.config_file = ""
    assert loaded == JobConfig()


def test_dump_has_every_section():
    text = dump_job_config(JobConfig())
    for section in ConfigManager().schema:
        assert f"[{section}]" in text
    assert "[model.args]" in text
