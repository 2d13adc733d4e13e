"""The input checks before anything is written: the data files as the actors read them,
the loop bounds they set, and whether the built-in model fits in memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from miles_events.app import memory, preflight
from miles_events.app.config import ConfigError
from miles_events.app.preflight import (
    INPUT_ERRORS,
    available_memory,
    check_builtin_fits,
    check_data,
    load_and_check,
)
from miles_events.rl.model_size import BUILTIN_VOCAB_SIZE, builtin_build_bytes, builtin_parameter_count
from miles_events.rl.prompts import DataError
from schemas.config import (
    BuiltinModelConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)

GOOD = b'{"input": "1+1=", "label": "2"}\n'
BAD = {
    "missing keys": (b'{"input": "1+1="}\n', ":1: needs the keys 'input' and 'label'"),
    "bad JSON": (GOOD + b"{\n", ":2: not valid JSON"),
    "empty": (b"", ": no prompts"),
    "not UTF-8": (GOOD + b"\xc3\x28\n", ":2: not UTF-8 text (byte 0xc3 at offset 32)"),
}


def data_config(
    tmp_path: Path, prompts: bytes = GOOD * 4, eval_data: bytes | None = None, **run: object
) -> Config:
    (tmp_path / "prompts.jsonl").write_bytes(prompts)
    eval_path = None
    if eval_data is not None:
        eval_path = tmp_path / "eval.jsonl"
        eval_path.write_bytes(eval_data)
    data = DataConfig(
        prompt_data=str(tmp_path / "prompts.jsonl"),
        eval_data=str(eval_path) if eval_path else None,
        rollout_batch_size=2,
    )
    return Config(run=RunConfig(dir=str(tmp_path / "run"), **run), data=data)  # type: ignore[arg-type]


def test_good_data_passes(tmp_path: Path) -> None:
    check_data(data_config(tmp_path, eval_data=GOOD))


@pytest.mark.parametrize("problem", sorted(BAD))
def test_bad_eval_data_is_a_data_error_naming_the_key(tmp_path: Path, problem: str) -> None:
    content, expected = BAD[problem]
    with pytest.raises(DataError) as caught:
        check_data(data_config(tmp_path, eval_data=content))
    assert str(caught.value).startswith(f"data.eval_data: {tmp_path / 'eval.jsonl'}{expected}")


@pytest.mark.parametrize("problem", sorted(BAD))
def test_bad_prompt_data_is_a_data_error_even_with_num_rollout_given(tmp_path: Path, problem: str) -> None:
    content, expected = BAD[problem]
    with pytest.raises(DataError) as caught:
        check_data(data_config(tmp_path, prompts=content, num_rollout=3))
    assert str(caught.value).startswith(f"data.prompt_data: {tmp_path / 'prompts.jsonl'}{expected}")


def test_an_unset_num_rollout_needs_one_whole_batch(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="fewer than one rollout batch"):
        check_data(data_config(tmp_path, prompts=GOOD))
    check_data(data_config(tmp_path, prompts=GOOD, num_rollout=1))  # a given num_rollout cycles


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("tie", [False, True])
def test_the_parameter_count_is_the_built_models(architecture: str, tie: bool) -> None:
    from miles_events.rl.hf_model import build_arith_tokenizer, build_builtin

    assert len(build_arith_tokenizer()) == BUILTIN_VOCAB_SIZE
    builtin = BuiltinModelConfig(
        architecture=architecture,  # type: ignore[arg-type]
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    model, _ = build_builtin(builtin, seed=0)
    assert builtin_parameter_count(builtin) == sum(p.numel() for p in model.parameters())
    assert builtin_build_bytes(builtin) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_builtin_model_larger_than_the_memory_is_refused() -> None:
    config = Config(model=ModelConfig(builtin=BuiltinModelConfig(hidden_size=100_000_000)))
    with pytest.raises(ConfigError) as caught:
        check_builtin_fits(config, available=8 * 2**30)
    assert caught.value.key == "model.builtin"
    assert str(caught.value) == (
        "model.builtin: 60,000,081,300,000,000 parameters (hidden_size 100000000, intermediate_size 128, "
        "num_hidden_layers 2) take 223,517,720.8 GiB in float32, more than the 8.0 GiB of memory available; "
        "choose smaller sizes or set model.path"
    )


def test_the_memory_check_passes_what_fits_and_skips_what_it_cannot_know() -> None:
    config = Config()
    needed = builtin_build_bytes(config.model.builtin)
    check_builtin_fits(config, available=needed)
    with pytest.raises(ConfigError):
        check_builtin_fits(config, available=needed - 1)
    check_builtin_fits(config, available=None)
    check_builtin_fits(Config(model=ModelConfig(path="/some/model")), available=0)  # not the built-in model


def test_available_memory_reads_mem_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    assert available_memory() == 2048 * 1024


def test_available_memory_without_meminfo_asks_sysconf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "absent")
    available = available_memory()
    assert available is None or available > 0


def test_load_and_check_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "prompts.jsonl").write_bytes(GOOD)
    (tmp_path / "eval.jsonl").write_bytes(b"\xff")
    path = tmp_path / "run.toml"
    path.write_text(
        '[run]\nnum_rollout = 1\ndir = "run"\n[data]\nprompt_data = "prompts.jsonl"\neval_data = "eval.jsonl"\n'
    )
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(INPUT_ERRORS, match=r"^data.eval_data: .*eval.jsonl:1: not UTF-8 text"):
        load_and_check(path)
    assert load_and_check(path, [f'data.eval_data="{tmp_path / "prompts.jsonl"}"']).run.num_rollout == 1
    assert sorted(tmp_path.rglob("*")) == before


def test_a_rollout_that_cannot_fit_is_refused_naming_its_sizes() -> None:
    """``data.n_samples_per_prompt = 1e9`` grew to 24 GB and was OOM-killed: refused first."""
    config = Config(data=DataConfig(rollout_batch_size=64, n_samples_per_prompt=10**9))
    with pytest.raises(
        ConfigError, match=r"a rollout of 64,000,000,000 samples .* needs about .* GiB of memory, more than"
    ):
        preflight.check_rollout_fits(config, available=24 * 2**30, longest_prompt=8)
    # The embedded default's rollout (4096 samples) needs a few MiB.
    preflight.check_rollout_fits(
        Config(data=DataConfig(rollout_batch_size=64, n_samples_per_prompt=64)), 2**30, 8
    )


def test_the_rollout_estimate_grows_with_what_it_holds() -> None:
    shape = memory.ModelShape.from_builtin(BuiltinModelConfig(), 4)
    small = memory.rollout_memory(
        shape, samples=4096, prompt_tokens=8, max_new_tokens=3, engine_batch=4096, micro_batch=1024
    )
    more = memory.rollout_memory(
        shape, samples=8192, prompt_tokens=8, max_new_tokens=3, engine_batch=4096, micro_batch=1024
    )
    longer = memory.rollout_memory(
        shape, samples=4096, prompt_tokens=40, max_new_tokens=3, engine_batch=4096, micro_batch=1024
    )
    assert more.batch_bytes == 2 * small.batch_bytes and more.engine_bytes == small.engine_bytes
    assert longer.host_bytes(on_gpu=False) > small.host_bytes(on_gpu=False) > small.host_bytes(on_gpu=True)


def test_a_gpu_is_seen_without_torch_where_the_driver_lists_one_in_this_container_and_none_is_hidden(
    tmp_path, monkeypatch
):
    gpus, control = tmp_path / "gpus", tmp_path / "nvidiactl"
    monkeypatch.setattr(memory, "NVIDIA_GPUS", gpus)
    monkeypatch.setattr(memory, "NVIDIA_CONTROL", control)
    monkeypatch.setattr(memory, "AMD_KFD", tmp_path / "kfd")
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    assert not memory.cuda_present(), "no NVIDIA driver"
    gpus.mkdir()
    (gpus / "0000:01:00.0").mkdir()
    assert not memory.cuda_present(), "the host's GPU, not passed to this container"
    control.touch()
    assert memory.cuda_present()
    for hidden in ("", "-1", " , ", "-1,0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not memory.cuda_present(), f"CUDA_VISIBLE_DEVICES={hidden!r}"
    for shown in ("0", "1,0", "GPU-5f3a"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", shown)
        assert memory.cuda_present(), f"CUDA_VISIBLE_DEVICES={shown!r}"
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "void")
    assert not memory.cuda_present()
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    control.unlink()
    (tmp_path / "kfd").touch()
    assert memory.cuda_present(), "ROCm"


GPU_SETTINGS = [
    ("rollout", "decode", "cuda_graph", "auto", 'rollout.decode: "cuda_graph" needs a CUDA GPU'),
    ("publisher", "transport", "cuda_ipc", "shm", 'publisher.transport: "cuda_ipc" needs a CUDA GPU'),
    ("trainer", "gpus_per_rank", 1.0, 0.0, "trainer.gpus_per_rank: 1 needs a CUDA GPU for each trainer rank"),
]


@pytest.mark.parametrize(("section", "key", "value", "other", "message"), GPU_SETTINGS)
@pytest.mark.parametrize(
    ("runtime", "address", "present", "refused"),
    [
        ("ray", None, False, True),
        ("local", None, False, True),
        ("local", "ray://head:10001", False, True),  # the local runtime runs its actors here
        ("ray", "ray://head:10001", False, False),  # a joined cluster's hosts are not asked
        ("ray", None, True, False),
    ],
)
def test_a_setting_that_needs_a_gpu_is_refused_where_the_actors_run_without_one(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    section: str,
    key: str,
    value: object,
    other: object,
    message: str,
    runtime: str,
    address: str | None,
    present: bool,
    refused: bool,
) -> None:
    import msgspec

    from schemas.config import RayConfig

    monkeypatch.setattr(preflight, "cuda_present", lambda: present)
    base = data_config(tmp_path, runtime=runtime)

    def with_value(chosen: object) -> Config:
        changed = msgspec.structs.replace(getattr(base, section), **{key: chosen})
        return msgspec.structs.replace(base, **{section: changed}, ray=RayConfig(address=address))

    if refused:
        with pytest.raises(ConfigError, match=message) as caught:
            preflight.check_device(with_value(value))
        assert caught.value.key == f"{section}.{key}"
        assert "\n" not in str(caught.value)
    else:
        preflight.check_device(with_value(value))
    preflight.check_device(with_value(other))


def vllm_config(tmp_path: Path, **builtin: int) -> Config:
    import msgspec

    from schemas.config import GeneratorConfig

    return msgspec.structs.replace(
        data_config(tmp_path),
        generator=GeneratorConfig(engine="vllm"),
        model=ModelConfig(builtin=BuiltinModelConfig(**builtin)),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("builtin", "fix"),
    [
        ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}, "num_attention_heads = 2"),
        ({"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4}, "num_attention_heads = 4"),
        (
            {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4},
            "num_attention_heads = 2 and model.builtin.num_key_value_heads = 2",
        ),
    ],
)
def test_a_builtin_head_dimension_below_32_is_refused_for_vllm_naming_the_keys_and_the_fix(
    tmp_path: Path, builtin: dict[str, int], fix: str
) -> None:
    config = vllm_config(tmp_path, **builtin)
    head_dim = builtin["hidden_size"] // builtin["num_attention_heads"]
    with pytest.raises(ConfigError) as caught:
        preflight.check_vllm_head_size(config)
    message = str(caught.value)
    assert message.startswith(
        f"model.builtin.num_attention_heads: a head dimension of {head_dim} (model.builtin.hidden_size "
        f"{builtin['hidden_size']} / model.builtin.num_attention_heads {builtin['num_attention_heads']}) "
    ), message
    assert (
        'generator.engine = "vllm"' in message and f"set model.builtin.{fix} (head dimension 32)" in message
    )
    assert caught.value.key == "model.builtin.num_attention_heads" and "\n" not in message


def test_a_head_dimension_vllm_serves_passes_and_other_engines_are_not_asked(tmp_path: Path) -> None:
    import msgspec

    from schemas.config import GeneratorConfig

    preflight.check_vllm_head_size(
        vllm_config(tmp_path, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    )
    small = vllm_config(tmp_path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    preflight.check_vllm_head_size(msgspec.structs.replace(small, generator=GeneratorConfig(engine="torch")))


def test_a_model_directory_whose_head_dimension_vllm_cannot_serve_is_refused(tmp_path: Path) -> None:
    import json

    import msgspec

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 256, "num_attention_heads": 4, "head_dim": 16})
    )
    config = vllm_config(tmp_path)
    config = msgspec.structs.replace(config, model=ModelConfig(path=str(model)))
    with pytest.raises(ConfigError) as caught:
        preflight.check_vllm_head_size(config)
    message = str(caught.value)
    assert message.startswith(
        f"model.path: {model / 'config.json'} gives a head dimension of 16 (head_dim)"
    ), message
    assert caught.value.key == "model.path" and "\n" not in message
    (model / "config.json").write_text(json.dumps({"hidden_size": 256, "num_attention_heads": 4}))
    preflight.check_vllm_head_size(config)  # 64
    (model / "config.json").write_text("{")
    preflight.check_vllm_head_size(config)  # unreadable: the server says what it cannot read


# --- the model directory (model.path) ----------------------------------------------------


def with_model(path: Path) -> Config:
    return Config(model=ModelConfig(path=str(path)))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:5000])


def set_model_type(path: Path) -> None:
    import json

    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "model_type": "nonsense"}))


DAMAGE = {
    "no directory": (lambda d: shutil.rmtree(d), "model.path: no such directory {d}"),
    "a file": (lambda d: (shutil.rmtree(d), d.write_text("")), "model.path: {d} is not a directory"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "model.path: {d} has no config.json"),
    "config.json not JSON": (
        lambda d: (d / "config.json").write_text("{"),
        "model.path: {d}/config.json: not valid JSON",
    ),
    "an unknown model_type": (
        lambda d: set_model_type(d / "config.json"),
        "model.path: {d}/config.json: model_type 'nonsense' is not an architecture transformers",
    ),
    "no tokenizer": (
        lambda d: [(d / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json")],
        "model.path: {d} has no tokenizer (none of tokenizer.json,",
    ),
    "no weights": (
        lambda d: (d / "model.safetensors").unlink(),
        "model.path: {d} has no *.safetensors weights",
    ),
    "truncated weights": (
        lambda d: truncate(d / "model.safetensors"),
        "model.path: {d}/model.safetensors: 5,000 bytes where its header's tensors end at ",
    ),
    "weights that are not safetensors": (
        lambda d: (d / "model.safetensors").write_bytes(b"\0" * 4),
        "model.path: {d}/model.safetensors: not a readable safetensors file (",
    ),
}


def test_a_good_model_directory_passes_and_gives_its_tokenizer_and_positions(model_dir: Path) -> None:
    checked = preflight.check_model_path(with_model(model_dir))
    assert checked is not None and checked.max_positions == 64
    assert checked.tokenizer("1+1=")["input_ids"] == [4, 13, 4, 16]
    assert preflight.check_model_path(Config()) is None, "the built-in model is built, not checked"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_model_directory_is_refused_naming_the_file(
    model_dir: Path, tmp_path: Path, damage: str
) -> None:
    """Each was an exit 1 after the run directory was written (a missing directory: Hugging
    Face's "Repo id must be in the form ..."; no tokenizer: no tokens at the first eval)."""
    damaged = tmp_path / "model"
    shutil.copytree(model_dir, damaged)
    harm, expected = DAMAGE[damage]
    harm(damaged)
    with pytest.raises(ConfigError) as caught:
        preflight.check_model_path(with_model(damaged))
    assert caught.value.key == "model.path"
    assert str(caught.value).startswith(expected.format(d=damaged)) and "\n" not in str(caught.value)


def test_a_sharded_model_missing_a_file_its_index_names_is_refused(model_dir: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "model"
    shutil.copytree(model_dir, damaged)
    (damaged / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    )
    with pytest.raises(
        ConfigError, match=r"model.safetensors.index.json names 1 missing file\(s\): model-00002"
    ):
        preflight.check_model_path(with_model(damaged))


# --- the prompts with the run's tokenizer, and the reward function ------------------------


def test_a_prompt_the_builtin_tokenizer_finds_no_token_in_is_refused_naming_its_line(tmp_path: Path) -> None:
    """``abc`` has no token for the built-in model (its saved tokenizer is Qwen2's byte-level
    one over digits and signs): the first eval failed with ``prompt 'abc' has no tokens``."""
    config = data_config(tmp_path, prompts=GOOD * 3 + b'{"input": "abc", "label": "1"}\n')
    with pytest.raises(DataError) as caught:
        preflight.check_prompts(config, preflight.read_data(config), None)
    assert str(caught.value) == (
        f"data.prompt_data: {tmp_path / 'prompts.jsonl'}:4: the prompt 'abc' has no tokens with the built-in "
        "model's tokenizer"
    )


def test_a_prompt_without_tokens_is_refused_with_a_model_path(model_dir: Path, tmp_path: Path) -> None:
    config = msgspec.structs.replace(
        data_config(tmp_path, eval_data=b'{"input": "", "label": "1"}\n'),
        model=ModelConfig(path=str(model_dir)),
    )
    checked = preflight.check_model_path(config)
    with pytest.raises(
        DataError,
        match=r"^data.eval_data: .*eval.jsonl:1: the prompt '' has no tokens with the tokenizer of ",
    ):
        preflight.check_prompts(config, preflight.read_data(config), checked)


def test_new_tokens_beyond_the_models_positions_are_refused_naming_both_numbers_and_keys(
    tmp_path: Path,
) -> None:
    """859-token responses were decoded on a 64-position model."""
    config = data_config(tmp_path, prompts=GOOD + b'{"input": "12+34=", "label": "46"}\n' + GOOD)
    config = msgspec.structs.replace(config, rollout=RolloutConfig(max_new_tokens=859))
    with pytest.raises(ConfigError) as caught:
        preflight.check_prompts(config, preflight.read_data(config), None)
    assert caught.value.key == "rollout.max_new_tokens"
    assert str(caught.value) == (
        f"rollout.max_new_tokens: 859 after the longest prompt (6 tokens, data.prompt_data "
        f"{tmp_path / 'prompts.jsonl'}:2) make 865 tokens, more than the model's 64 positions "
        "(model.builtin.max_position_embeddings); lower rollout.max_new_tokens to 58 or less"
    )
    fits = msgspec.structs.replace(config, rollout=RolloutConfig(max_new_tokens=58))
    preflight.check_prompts(fits, preflight.read_data(fits), None)


def test_positions_are_those_of_the_model_path(model_dir: Path, tmp_path: Path) -> None:
    config = msgspec.structs.replace(
        data_config(tmp_path),
        model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(max_new_tokens=61),
    )
    with pytest.raises(ConfigError, match=rf"\(max_position_embeddings of {model_dir}/config.json\)"):
        preflight.check_prompts(config, preflight.read_data(config), preflight.check_model_path(config))


def reward_config(tmp_path: Path, reward_fn: str) -> Config:
    return msgspec.structs.replace(data_config(tmp_path), rollout=RolloutConfig(reward_fn=reward_fn))


@pytest.mark.parametrize(
    ("reward_fn", "expected"),
    [
        (
            "tests.e2e_rewards.two_arguments",
            "rollout.reward_fn: tests.e2e_rewards.two_arguments takes (prompt, response), not "
            "(prompt, response, label) or (prompt, response, label, *, row)",
        ),
        (
            "tests.e2e_rewards.broken",
            "rollout.reward_fn: tests.e2e_rewards.broken raised ValueError: reward service unavailable, on the "
            "first prompt of data.prompt_data ({data}:1) with its label as the response",
        ),
        (
            "tests.e2e_rewards.text",
            "rollout.reward_fn: tests.e2e_rewards.text returned '1.0' (a str), not a number, on the first prompt "
            "of data.prompt_data ({data}:1) with its label as the response",
        ),
        (
            "tests.e2e_rewards.nan",
            "rollout.reward_fn: tests.e2e_rewards.nan returned nan, not a finite number, on the first prompt "
            "of data.prompt_data ({data}:1) with its label as the response",
        ),
    ],
)
def test_a_reward_function_that_cannot_score_the_first_sample_is_refused(
    tmp_path: Path, reward_fn: str, expected: str
) -> None:
    """A wrong signature and a raising function failed at the first eval; a text reward was
    accepted (``float`` reads ``"1.0"``)."""
    config = reward_config(tmp_path, reward_fn)
    with pytest.raises(ConfigError) as caught:
        preflight.check_reward_fn(config, preflight.read_data(config))
    assert caught.value.key == "rollout.reward_fn"
    assert str(caught.value) == expected.format(data=tmp_path / "prompts.jsonl")


@pytest.mark.parametrize(
    "reward_fn", ["miles_events.rl.rewards.exact_match", "tests.e2e_rewards.true_when_right"]
)
def test_a_reward_function_returning_a_real_number_passes(tmp_path: Path, reward_fn: str) -> None:
    config = reward_config(tmp_path, reward_fn)
    preflight.check_reward_fn(config, preflight.read_data(config))


# --- the group size ------------------------------------------------------------------------


def test_one_sample_per_prompt_is_refused_as_grpo_learns_nothing_from_it() -> None:
    """GRPO's advantage is a sample's reward less its group's mean: 0 in a group of one."""
    for normalize in (True, False):  # GRPO and Dr.GRPO
        config = Config(
            data=DataConfig(n_samples_per_prompt=1), trainer=TrainerConfig(normalize_advantage_std=normalize)
        )
        with pytest.raises(ConfigError) as caught:
            preflight.check_group_size(config)
        assert caught.value.key == "data.n_samples_per_prompt"
        assert str(caught.value) == (
            "data.n_samples_per_prompt: 1 sample per prompt trains nothing: GRPO's advantage is a sample's reward "
            "less the mean of its prompt's group, 0 in a group of one; sample at least 2"
        )
    preflight.check_group_size(Config(data=DataConfig(n_samples_per_prompt=2)))


def test_one_sample_per_prompt_is_accepted_where_nothing_is_trained() -> None:
    rollout_only = RunConfig(
        rollout_only_from_checkpoint=True, load="/ckpt", rollout_only_publication_evidence="/e"
    )
    preflight.check_group_size(Config(run=rollout_only, data=DataConfig(n_samples_per_prompt=1)))
    preflight.check_group_size(Config(run=RunConfig(num_rollout=0), data=DataConfig(n_samples_per_prompt=1)))


@pytest.mark.slow
def test_on_the_ray_runtime_the_model_checks_run_in_a_child_and_the_driver_imports_no_torch(
    tmp_path: Path,
) -> None:
    """The driver of a ray run imports neither torch nor transformers: the checks that need
    them run in a child process and its error is raised here as it was found there."""
    import subprocess
    import sys

    (tmp_path / "good.jsonl").write_bytes(GOOD * 4)
    (tmp_path / "bad.jsonl").write_bytes(GOOD + b'{"input": "abc", "label": "1"}\n')
    code = (
        "import sys\n"
        "from miles_events.app.preflight import DataError, check_input\n"
        "from schemas.config import Config, DataConfig, RunConfig\n"
        "def config(name):\n"
        f"    return Config(run=RunConfig(runtime='ray', num_rollout=1), data=DataConfig(prompt_data={str(tmp_path)!r} + '/' + name))\n"
        "check_input(config('good.jsonl'))\n"
        "try:\n"
        "    check_input(config('bad.jsonl'))\n"
        "except DataError as error:\n"
        "    print(error)\n"
        "print(','.join(m for m in ('torch', 'transformers', 'tokenizers', 'safetensors') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.splitlines() == [
        f"data.prompt_data: {tmp_path}/bad.jsonl:2: the prompt 'abc' has no tokens with the built-in model's tokenizer",
        "",
    ], done.stderr[-2000:]


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("trainer", "autocast", "bfloat16"), ("megatron", "transformer_impl", "transformer_engine")],
)
def test_the_megatron_backends_gpu_only_settings_are_refused_without_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str, key: str, value: str
) -> None:
    import msgspec

    monkeypatch.setattr(preflight, "cuda_present", lambda: False)
    base = data_config(tmp_path, runtime="local")
    megatron = msgspec.structs.replace(
        base, trainer=msgspec.structs.replace(base.trainer, backend="megatron")
    )
    config = msgspec.structs.replace(
        megatron, **{section: msgspec.structs.replace(getattr(megatron, section), **{key: value})}
    )
    with pytest.raises(ConfigError, match=f'{section}.{key}: "{value}"') as caught:
        preflight.check_device(config)
    assert "needs a CUDA GPU" in str(caught.value)
    if section == "trainer":  # the torch backend autocasts on the CPU
        preflight.check_device(
            msgspec.structs.replace(config, trainer=msgspec.structs.replace(config.trainer, backend="torch"))
        )
