"""Config loading: strict decoding with located one-line errors, overrides, checks, dump."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_events.app.config import (
    ConfigError,
    config_digest,
    dump_config,
    find_key_line,
    load_config,
    load_config_text,
    parse_override,
    validate,
)
from schemas.config import Config, DataConfig

PROMPTS = '{"input": "1+1=", "label": "2"}\n'


def write_config(tmp_path: Path, body: str) -> Path:
    (tmp_path / "prompts.jsonl").write_text(PROMPTS)
    path = tmp_path / "run.toml"
    path.write_text(body)
    return path


BASE = '[data]\nprompt_data = "prompts.jsonl"\nrollout_batch_size = 4\nn_samples_per_prompt = 4\n'


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides or [])
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_valid_file_loads(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, BASE + "[run]\nseed = 7\n"))
    assert config.run.seed == 7
    assert config.data.rollout_batch_size == 4


def test_unknown_key_names_its_path_and_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE + "\n[run]\nseed = 1\nfoo = 2\n")
    message = error_of(path)
    assert message.startswith(f"{path}:8: run.foo: unknown key")


def test_misspelled_key_suggests_the_known_one(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE + "[run]\nnum_rolout = 3\n"))
    assert "run.num_rolout" in message and "did you mean num_rollout?" in message


def test_unknown_section_is_an_unknown_key(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE + "[runn]\nseed = 1\n")
    assert error_of(path).startswith(f"{path}:5: runn: unknown key")


def test_wrong_type_names_the_path_and_both_types(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE + '[run]\nseed = "abc"\n')
    assert error_of(path) == f"{path}:6: run.seed: expected int, got str"


def test_out_of_range_value_says_the_bound(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE.replace("rollout_batch_size = 4", "rollout_batch_size = 0"))
    assert error_of(path) == f"{path}:3: data.rollout_batch_size: must be >= 1"


def test_invalid_choice_lists_the_choices(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE + '[run]\nruntime = "slurm"\n'))
    assert "run.runtime" in message and "'local'" in message and "'ray'" in message


def test_nested_table_key_is_located(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE + "[model.builtin]\nhidden_size = 1.5\n")
    assert error_of(path) == f"{path}:6: model.builtin.hidden_size: expected int, got float"


def test_toml_syntax_error_is_one_line_with_position(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, "[run\nseed = 1\n"))
    assert "TOML syntax error" in message and "line 1" in message


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    assert error_of(tmp_path / "absent.toml") == f"{tmp_path / 'absent.toml'}: no such config file"


def test_set_overrides_a_value(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, BASE), ["run.num_rollout=3"])
    assert config.run.num_rollout == 3


def test_set_creates_missing_tables_and_parses_toml_values(tmp_path: Path) -> None:
    config = load_config(
        write_config(tmp_path, BASE),
        ['rollout.stop=["\\n", "END"]', "verifier.enabled=false", "rollout.top_p=0.5"],
    )
    assert config.rollout.stop == ["\n", "END"]
    assert config.verifier.enabled is False
    assert config.rollout.top_p == 0.5


def test_set_value_that_is_not_toml_is_a_string() -> None:
    assert parse_override("run.dir=runs/my run") == (["run", "dir"], "runs/my run")


def test_set_without_equals_is_an_error(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE), ["run.num_rollout"])
    assert "--set run.num_rollout" in message and "KEY=VALUE" in message


def test_set_with_bad_value_names_the_set_argument(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE + "[run]\nseed = 1\n")
    assert error_of(path, ["run.seed=x"]) == f"{path}: --set run.seed=x: run.seed: expected int, got str"


def test_set_through_a_non_table_is_an_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE + '[run]\ndir = "runs/a"\n')
    assert "--set run.dir.x=1: run.dir is a str, not a table" in error_of(path, ["run.dir.x=1"])


def test_set_creating_a_table_where_a_value_belongs_names_the_set(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE)
    assert error_of(path, ["run.dir.x=1"]) == f"{path}: --set run.dir.x=1: run.dir: expected str, got table"


def test_relative_paths_resolve_against_the_config_directory(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, BASE + '[run]\ndir = "runs/a"\n'))
    assert config.run.dir == str(tmp_path / "runs" / "a")
    assert config.data.prompt_data == str(tmp_path / "prompts.jsonl")


def test_relative_paths_from_set_resolve_against_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    path = write_config(tmp_path / "conf", BASE)
    monkeypatch.chdir(tmp_path)
    config = load_config(path, ["run.dir=out"])
    assert config.run.dir == os.path.join(str(tmp_path), "out")


def test_missing_prompt_data_is_an_error_unless_no_rollouts(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE.replace("prompts.jsonl", "absent.jsonl"))
    assert error_of(path).startswith(f"{path}:2: data.prompt_data: no such file")
    assert load_config(path, ["run.num_rollout=0"]).run.num_rollout == 0


@pytest.mark.parametrize("key", ["prompt_data", "eval_data"])
def test_data_that_is_a_directory_is_named_as_one(tmp_path: Path, key: str) -> None:
    (tmp_path / "data").mkdir()
    path = write_config(
        tmp_path, BASE + f'{key} = "data"\n' if key == "eval_data" else BASE.replace("prompts.jsonl", "data")
    )
    assert f"data.{key}: {tmp_path / 'data'} is a directory, not a file" in error_of(path)


@pytest.mark.parametrize("key", ["prompt_data", "eval_data"])
def test_data_that_is_a_fifo_or_a_device_is_named_for_what_it_is(tmp_path: Path, key: str) -> None:
    os.mkfifo(tmp_path / "fifo")
    path = write_config(tmp_path, BASE)
    assert f"data.{key}: {tmp_path / 'fifo'} is not a regular file (a FIFO)" in error_of(
        path, [f'data.{key}="{tmp_path / "fifo"}"']
    )
    assert f"data.{key}: /dev/null is not a regular file (a character device)" in error_of(
        path, [f'data.{key}="/dev/null"']
    )


def test_a_config_file_that_starts_with_a_utf8_bom_loads(tmp_path: Path) -> None:
    """Editors on Windows write one; the TOML reader took it for a statement."""
    path = write_config(tmp_path, "")
    path.write_bytes(b"\xef\xbb\xbf" + (BASE + "[run]\nseed = 7\n").encode())
    assert load_config(path).run.seed == 7
    path.write_bytes(b"\xef\xbb\xbf" + (BASE + "[run]\nsed = 7\n").encode())
    assert error_of(path).startswith(f"{path}:6: run.sed: unknown key"), "lines are counted as before"


def test_global_batch_must_divide_the_rollout_samples(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE), ["trainer.global_batch_size=5"])
    assert "trainer.global_batch_size" in message and "16" in message


def test_micro_batch_may_not_exceed_the_global_batch(tmp_path: Path) -> None:
    message = error_of(
        write_config(tmp_path, BASE), ["trainer.global_batch_size=8", "trainer.micro_batch_size=9"]
    )
    assert "trainer.micro_batch_size" in message


def test_rollout_logprobs_are_refused_at_a_temperature_other_than_one(tmp_path: Path) -> None:
    config = write_config(tmp_path, BASE)
    message = error_of(config, ["trainer.use_rollout_logprobs=true", "rollout.temperature=0.7"])
    assert "trainer.use_rollout_logprobs: the engine" in message and "(0.7)" in message
    load_config(config, ["trainer.use_rollout_logprobs=true", "rollout.temperature=1.0"])


def test_reward_fn_must_be_importable(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE), ["rollout.reward_fn=no_such_module.reward"])
    assert "rollout.reward_fn" in message


def test_an_unknown_engine_backend_names_the_known_ones(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE + '[generator]\nengine = "sglangg"\n'))
    assert (
        message
        == f"{tmp_path / 'run.toml'}:6: generator.engine: unknown engine 'sglangg'; known: sglang, torch, vllm"
    )


def test_an_unknown_trainer_backend_names_the_known_ones(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE), ['trainer.backend="megatronn"'])
    assert message.endswith(
        '--set trainer.backend="megatronn": trainer.backend: unknown trainer backend '
        "'megatronn'; known: megatron, torch"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["megatron.tensor_parallel_size=2"],
            "megatron.tensor_parallel_size: 2: tensor parallelism is not built yet; the megatron backend's "
            "trainer.num_ranks ranks are data-parallel replicas (set it to 1)",
        ),
        (
            ["megatron.pipeline_parallel_size=4"],
            "megatron.pipeline_parallel_size: 4: pipeline parallelism is not built yet",
        ),
        (
            ['trainer.sharding="fsdp2"'],
            "trainer.sharding: \"fsdp2\" is the torch backend's; the megatron backend's ranks are "
            'data-parallel replicas: leave it "auto" (or "ddp")',
        ),
        (
            ['megatron.transformer_impl="transformer_engine"'],
            'megatron.transformer_impl: "transformer_engine" needs Transformer Engine, which is not installed',
        ),
    ],
)
def test_what_the_megatron_backend_cannot_do_is_refused_in_one_line(
    tmp_path: Path, overrides, message
) -> None:
    pytest.importorskip("megatron.core")
    if "transformer_engine" in message:
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is not None:
            pytest.skip("Transformer Engine is installed here")
    got = error_of(write_config(tmp_path, BASE), ['trainer.backend="megatron"', *overrides])
    assert message in got


def test_the_megatron_section_without_the_megatron_backend_is_refused(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE), ["megatron.pipeline_parallel_size=2"])
    assert message.endswith(
        'megatron.pipeline_parallel_size: set for the megatron trainer backend, and trainer.backend is "torch"'
    )


def test_a_model_the_megatron_backend_cannot_convert_is_refused_before_the_run(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gemma2", "num_hidden_layers": 2}')
    message = error_of(write_config(tmp_path, BASE), ['trainer.backend="megatron"', f'model.path="{model}"'])
    assert message.endswith(
        "model.path: the megatron trainer backend: model type 'gemma2' has no Megatron conversion; "
        "converted: llama, qwen2"
    )


def test_num_engines_in_its_old_section_names_its_new_place(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE + "[rollout]\nnum_engines = 2\n"))
    assert "rollout.num_engines: unknown key (moved to generator.num_engines)" in message


def test_own_process_takes_the_light_actors_only(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, BASE), ['ray.own_process=["saver", "verifier"]'])
    assert config.ray.own_process == ["saver", "verifier"]
    for name in ("trainer", "coordinator", "savr"):
        message = error_of(write_config(tmp_path, BASE), [f'ray.own_process=["{name}"]'])
        assert f"ray.own_process: '{name}' is not a light actor" in message
        assert "publisher, verifier, saver" in message


def test_validate_accepts_the_defaults_with_existing_prompts(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text(PROMPTS)
    validate(Config(data=DataConfig(prompt_data=str(tmp_path / "p.jsonl"))))


def test_dump_then_load_gives_the_same_config(tmp_path: Path) -> None:
    config = load_config(
        write_config(tmp_path, BASE),
        [
            'rollout.stop=["a\\"b", "tab\\t", "x\\u007f", "back\\\\slash"]',
            "run.save_interval=2",
            "trainer.lr=3e-05",
        ],
    )
    assert config.rollout.stop == ['a"b', "tab\t", "x\x7f", "back\\slash"]
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(dump_config(config))
    assert load_config(dumped) == config


def test_dump_marks_unset_values_as_comments() -> None:
    assert "# num_rollout = (unset)" in dump_config(Config()).splitlines()


def test_digest_changes_with_any_value() -> None:
    assert config_digest(Config()) == config_digest(Config())
    assert config_digest(Config()) != config_digest(Config(data=DataConfig(rollout_batch_size=3)))


def test_embedded_text_loads_with_its_name_in_errors() -> None:
    with pytest.raises(ConfigError, match=r"^<default>:1: run.bogus: unknown key"):
        load_config_text("run.bogus = 1\n", name="<default>")


def test_key_line_finds_dotted_keys_under_tables() -> None:
    text = "[model]\nbuiltin.hidden_size = 3\n[run]\n  seed = 1 # comment\n"
    assert find_key_line(text, ["model", "builtin", "hidden_size"]) == 2
    assert find_key_line(text, ["run", "seed"]) == 4
    assert find_key_line(text, ["run"]) == 3
    assert find_key_line(text, ["data"]) is None


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("trainer.lr", "inf", "inf"),
        ("trainer.lr", "+inf", "inf"),
        ("trainer.lr", "1e400", "inf"),  # too large for a float: TOML reads it as inf
        ("trainer.entropy_coef", "nan", "nan"),
        ("trainer.entropy_coef", "-inf", "-inf"),
        ("rollout.temperature", "inf", "inf"),
        ("bus.stall_warning_seconds", "inf", "inf"),
    ],
)
def test_a_float_that_is_not_finite_is_refused_naming_the_key(
    tmp_path: Path, key: str, value: str, shown: str
) -> None:
    message = error_of(write_config(tmp_path, BASE), [f"{key}={value}"])
    assert (
        message
        == f"{tmp_path / 'run.toml'}: --set {key}={value}: {key}: must be a finite number, got {shown}"
    )


@pytest.mark.parametrize("value", ["nan", "-inf"])
def test_a_bounded_float_refuses_nan_and_minus_inf_as_not_finite_not_by_its_bound(
    tmp_path: Path, value: str
) -> None:
    message = error_of(write_config(tmp_path, BASE), [f"trainer.lr={value}"])
    assert message.endswith(f"trainer.lr: must be a finite number, got {value}")
    path = write_config(tmp_path, BASE + f"[trainer]\nclip_grad = {value}\n")
    assert error_of(path) == f"{path}:6: trainer.clip_grad: must be a finite number, got {value}"


def test_resume_and_overwrite_together_are_refused(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE), ["run.resume=true", "run.overwrite=true"])
    assert "run.overwrite: cannot be set with run.resume" in message


def test_no_sharding_with_several_trainer_ranks_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE)
    message = error_of(path, ["trainer.num_ranks=2", 'trainer.sharding="none"'])
    assert message.endswith(
        'trainer.sharding: "none" trains on one rank, not trainer.num_ranks = 2; shard with "fsdp2" '
        '(or "auto"), or replicate with "ddp"'
    )
    assert load_config(path, ["trainer.num_ranks=2"]).trainer.sharding == "auto"


@pytest.mark.parametrize(("runtime", "refused"), [("ray", True), ("local", False)])
def test_the_in_process_transport_needs_the_local_runtime(
    tmp_path: Path, runtime: str, refused: bool
) -> None:
    path = write_config(tmp_path, BASE)
    overrides = ['publisher.transport="inprocess"', f'run.runtime="{runtime}"']
    if refused:
        assert 'publisher.transport: "inprocess" keeps data in one process' in error_of(path, overrides)
    else:
        assert load_config(path, overrides).publisher.transport == "inprocess"


def test_a_float_that_is_not_finite_in_the_file_is_located(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE + "[publisher]\nstage_timeout = inf\n")
    assert error_of(path) == f"{path}:6: publisher.stage_timeout: must be a finite number, got inf"


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            "hidden_size = 64\nnum_attention_heads = 3",
            "model.builtin.num_attention_heads: 3 must divide model.builtin.hidden_size (64)",
        ),
        (
            "hidden_size = 12\nnum_attention_heads = 4\nnum_key_value_heads = 1",
            "model.builtin.num_attention_heads: 4 heads of model.builtin.hidden_size 12 are 3 wide; "
            "the head dimension must be even (rotary embeddings)",
        ),
        (
            "num_attention_heads = 4\nnum_key_value_heads = 3",
            "model.builtin.num_key_value_heads: 3 must divide model.builtin.num_attention_heads (4)",
        ),
    ],
)
def test_a_builtin_model_shape_that_cannot_run_is_refused(
    tmp_path: Path, settings: str, expected: str
) -> None:
    message = error_of(write_config(tmp_path, BASE + "[model.builtin]\n" + settings + "\n"))
    assert message.split(": ", 1)[1] == expected


def test_the_builtin_shape_is_not_checked_when_model_path_is_used(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    body = BASE + '[model]\npath = "model"\n[model.builtin]\nnum_attention_heads = 3\n'
    assert load_config(write_config(tmp_path, body)).model.builtin.num_attention_heads == 3


@pytest.mark.parametrize(
    ("value", "shown"),
    [("-1", "-1"), (str(2**63), str(2**63)), ("-" + "9" * 60, "-9999999999999999999... (61 digits)")],
)
def test_a_seed_out_of_range_is_refused(tmp_path: Path, value: str, shown: str) -> None:
    message = error_of(write_config(tmp_path, BASE), [f"run.seed={value}"])
    assert message.endswith(f"--set run.seed={value}: run.seed: must be 0 to 2**63 - 1, got {shown}")


def test_a_recorded_config_keeps_the_seed_it_ran_with(tmp_path: Path) -> None:
    assert (
        load_config(write_config(tmp_path, BASE + "[run]\nseed = -1\n"), check=False, recorded=True).run.seed
        == -1
    )


@pytest.mark.parametrize("value", ["0", str(2**63 - 1)])
def test_the_seed_range_ends_are_taken(tmp_path: Path, value: str) -> None:
    assert load_config(write_config(tmp_path, BASE), [f"run.seed={value}"]).run.seed == int(value)


def test_toml_python_cannot_read_is_one_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE + "[run]\nseed = " + "1" * 5000 + "\n")
    assert error_of(path).startswith(f"{path}: not readable as TOML (Exceeds the limit (4300 digits)")
    deep = write_config(tmp_path, "a = " + "[" * 100_000 + "\n")
    assert error_of(deep) == f"{deep}: not readable as TOML (nested too deeply)"


def test_a_set_value_python_cannot_read_is_one_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, BASE)
    assert error_of(path, ["run.seed=" + "9" * 5000]).startswith(
        f"{path}: --set run.seed={'9' * 5000}: value not readable as TOML (Exceeds the limit"
    )
    assert error_of(path, ["run.dir=" + "[" * 100_000]).endswith(
        ": value not readable as TOML (nested too deeply)"
    )


def test_a_set_argument_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    # What Python makes of a command-line byte that is not UTF-8 (surrogateescape).
    path = write_config(tmp_path, BASE)
    assert error_of(path, ["run.dir=runs/\udcff"]) == f"{path}: --set run.dir=runs/\\udcff: not UTF-8 text"


def test_a_relative_reward_fn_is_a_config_error(tmp_path: Path) -> None:
    message = error_of(write_config(tmp_path, BASE), ['rollout.reward_fn=".rewards.fn"'])
    assert "rollout.reward_fn: '.rewards.fn' is not a dotted path" in message


def test_an_unknown_key_with_a_line_break_is_an_unknown_key(tmp_path: Path) -> None:
    # TOML allows any string as a quoted key; the CLI escapes the break when it prints the line.
    path = write_config(tmp_path, BASE + '[run]\n"a\\nb" = 1\n')
    with pytest.raises(ConfigError, match=r"run\.a\nb: unknown key \(known: dir, "):
        load_config(path)


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

VLLM_EXAMPLE_CHANGES = {
    "run.dir": str(EXAMPLES.parent / "runs" / "vllm"),
    "run.runtime": "local",
    "model.builtin.num_attention_heads": 4,
    "model.builtin.num_key_value_heads": 2,
    "generator.engine": "vllm",
    "vllm.publication": "push",
}
"""What ``examples/vllm.toml`` changes of ``examples/tiny.toml``: vLLM on CPU's head size (its
unreadable linears are the vLLM engine's default ``verifier.skip_tensor_list``;
``tests/test_vllm_run.py`` runs it)."""


def _flat(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def test_the_vllm_example_passes_the_input_checks_and_is_tiny_with_what_vllm_on_cpu_needs() -> None:
    import msgspec

    from miles_events.app.preflight import load_and_check

    vllm = _flat(msgspec.to_builtins(load_and_check(EXAMPLES / "vllm.toml")))
    tiny = _flat(msgspec.to_builtins(load_config(EXAMPLES / "tiny.toml")))
    changed = {key: vllm[key] for key in vllm if vllm[key] != tiny.get(key)}
    assert changed == VLLM_EXAMPLE_CHANGES


@pytest.mark.parametrize(
    ("overrides", "starts"),
    [
        (['run.ft_components=["train"]'], "trainer.sharding: a trainer that heals runs its ranks"),
        (
            ['run.ft_components=["train"]', "trainer.num_ranks=2", "trainer.use_critic=true"],
            "trainer.use_critic: healing the trainer with a critic",
        ),
        (
            ['run.ft_components=["train"]', 'trainer.sharding="ddp"', "run.offload_train=true"],
            "run.offload_train: healing the trainer",
        ),
        (
            ['run.ft_components=["train"]', "trainer.num_ranks=2", "ray.colocate=true"],
            "ray.colocate: healing the trainer",
        ),
        (['run.ft_components=["rollout", "rollout"]'], "run.ft_components: each component once"),
        (
            ['run.ft_components=["rollout"]', "run.offload_rollout=true"],
            "run.ft_components: healing engines whose memory",
        ),
        (
            ['run.ft_components=["rollout"]', 'publisher.transport="inprocess"', 'run.runtime="local"'],
            'publisher.transport: "inprocess" cannot reach',
        ),
        (["run.mini_ft_controller=true"], "run.mini_ft_controller: needs the control server"),
        (
            ["run.mini_ft_controller=true", "run.control_server_port=8080"],
            "run.mini_ft_controller: heals cells, and there are none",
        ),
    ],
)
def test_what_healing_and_the_control_server_need_is_checked(
    tmp_path: Path, overrides: list[str], starts: str
) -> None:
    assert starts in error_of(write_config(tmp_path, BASE), overrides)


@pytest.mark.parametrize(
    ("overrides", "starts"),
    [
        (
            ["run.max_staleness=1", "trainer.use_critic=true"],
            "trainer.use_critic: asynchronous training with a critic",
        ),
        (
            ["run.fully_async=true", "run.offload_train=true"],
            "run.offload_train: asynchronous training needs",
        ),
        (
            ["run.max_staleness=2", "run.offload_rollout=true"],
            "run.offload_rollout: asynchronous training needs",
        ),
        (
            ["run.max_staleness=1", "ray.colocate=true"],
            "ray.colocate: asynchronous training needs the engines",
        ),
        (
            ["run.max_staleness=1", 'run.ft_components=["train"]', "trainer.num_ranks=2"],
            'run.ft_components: "train" with asynchronous training',
        ),
        (
            ["trainer.rollout_is_cap=2.0", "rollout.temperature=0.7"],
            "trainer.rollout_is_cap: the engine's logprobs",
        ),
        (["rollout.partial=true"], "rollout.partial: needs asynchronous training"),
        (
            [
                "rollout.partial=true",
                "run.max_staleness=1",
                'generator.engine="sglang"',
                'sglang.pause_mode="abort"',
            ],
            "rollout.partial: sglang.pause_mode = 'abort' would abort",
        ),
        (
            ["rollout.partial=true", "run.max_staleness=1", 'run.ft_components=["rollout"]'],
            "rollout.partial: with engines that heal",
        ),
    ],
)
def test_what_asynchronous_training_works_with_is_checked(
    tmp_path: Path, overrides: list[str], starts: str
) -> None:
    assert starts in error_of(write_config(tmp_path, BASE), overrides)
