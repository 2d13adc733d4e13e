"""A run whose data rows are chats, rendered with the model's chat template, scored by a
reward function that reads other columns of the row; and the engines stopping at the ids
of the model's generation config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles_events.rl.hf_model import chat_template, generation_eos_ids, load_tokenizer
from schemas.events import PublicationVerified, RolloutGenerated
from tests.test_e2e import events, run_cli

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""A chat template the built-in character tokenizer can encode: the contents, in turn."""


@pytest.fixture
def chat_model(model_dir: Path, tmp_path: Path) -> Path:
    """The built-in model with a chat template saved beside its tokenizer."""
    model = tmp_path / "chat-model"
    shutil.copytree(model_dir, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    return model


def test_the_chat_template_renders_a_chat_as_the_tokenizer_does(chat_model: Path) -> None:
    tokenizer = load_tokenizer(chat_model)
    render = chat_template(tokenizer)
    chat = [{"role": "system", "content": "1+"}, {"role": "user", "content": "1="}]
    assert render(chat) == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert render(chat) == "1+1="


def test_the_generation_configs_eos_ids_are_read_as_an_id_or_a_list(tmp_path: Path) -> None:
    assert generation_eos_ids(tmp_path) == []
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert generation_eos_ids(tmp_path) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 2, 9]}))
    assert generation_eos_ids(tmp_path) == [2, 9]


@pytest.mark.slow
def test_a_run_on_chat_rows_renders_them_and_its_reward_reads_the_row(
    chat_model: Path, tmp_path: Path
) -> None:
    data = tmp_path / "chat.jsonl"
    rows = [
        {"input": [{"role": "user", "content": f"{a}+{b}="}], "label": str(a + b), "weight": 0.25}
        for a in range(5)
        for b in range(5)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_cli(
        tmp_path / "run",
        f'model.path="{chat_model}"',
        f'data.prompt_data="{data}"',
        f'data.eval_data="{data}"',
        "data.apply_chat_template=true",
        'rollout.reward_fn="tests.e2e_rewards.row_weight"',
        'run.runtime="local"',
        "run.num_rollout=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = events(tmp_path / "run")
    generated = [e for e in log if isinstance(e, RolloutGenerated)]
    assert [e.reward_mean for e in generated] == [0.25, 0.25], "every reward is the row's weight"
    assert [e.weight_version for e in log if isinstance(e, PublicationVerified)] == ["1", "2", "3"]
