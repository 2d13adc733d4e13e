"""The one tied-weight rule, and the trainer, the engine and the checkpoint agreeing on it."""

from __future__ import annotations

from pathlib import Path

import torch

from actors.engine.torch_engine import TorchEngine
from actors.trainer_backend.torch_backend import TorchTrainerBackend
from miles_events.checkpoint.format import _safetensors_ready
from miles_events.rl.hf_model import prepare_base_model
from miles_events.rl.weights import split_tied, tensor_identity
from schemas.config import BuiltinModelConfig, Config, ModelConfig


def test_the_same_tensor_under_two_names_is_tied_to_the_first():
    embedding = torch.randn(4, 2)
    unique, tied = split_tied({"embed": embedding, "norm": torch.ones(2), "head": embedding})
    assert list(unique) == ["embed", "norm"] and tied == {"head": "embed"}


def test_other_views_of_one_buffer_are_distinct_tensors():
    buffer = torch.randn(6, 6)
    named = {
        "whole": buffer,
        "transposed": buffer.t(),
        "rows": buffer[2:4],
        "as_int": buffer.view(torch.int32),
        "copy": buffer.clone(),
    }
    unique, tied = split_tied(named)
    assert tied == {} and list(unique) == list(named)


def test_empty_and_meta_tensors_are_never_tied():
    empty = torch.zeros(0)
    assert tensor_identity(empty) is None and split_tied({"a": empty, "b": empty})[1] == {}
    meta = torch.empty(3, 3, device="meta")
    assert tensor_identity(meta) is None and split_tied({"a": meta, "b": meta})[1] == {}


def test_a_checkpoint_gives_each_tied_name_its_own_bytes():
    embedding = torch.randn(4, 2)
    ready = _safetensors_ready({"embed": embedding, "head": embedding})
    assert torch.equal(ready["embed"], ready["head"])
    assert ready["embed"].untyped_storage().data_ptr() != ready["head"].untyped_storage().data_ptr()


def test_trainer_and_engine_agree_on_the_names_of_a_tied_model(tmp_path: Path):
    model = ModelConfig(builtin=BuiltinModelConfig(tie_word_embeddings=True))
    path = prepare_base_model(model, tmp_path, seed=3)
    backend = TorchTrainerBackend(Config(model=ModelConfig(path=str(path))))
    engine = TorchEngine.from_pretrained(path)
    published = backend.named_weights()
    assert set(published) == set(engine.served_tensors())
    assert "lm_head.weight" not in published and "model.embed_tokens.weight" in published
