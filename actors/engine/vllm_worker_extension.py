"""Methods the vLLM engine adds to every vLLM worker (``--worker-extension-cls``).

This module is imported inside the vLLM server's worker processes, in vLLM's own
environment (``.venv-vllm``), with the repository root on ``PYTHONPATH``: it imports only
torch, safetensors and the project's dependency-light checksum helpers (and, to receive
over the collective transport, its reading end and msgspec, which vLLM needs too). The engine calls
each method over ``/collective_rpc``, whose arguments are strings (so tensors travel as
base64 safetensors bytes) and whose results are JSON.

- ``miles_push_weights``: load a publication pushed over HTTP (no shared filesystem needed)
  through vLLM's own in-place ``reload_weights``, and keep its canary in this worker's
  memory, copied in the same pass as the weights.
- ``miles_load_weights_from_dir``: the same from a safetensors directory the worker reads.
- ``miles_receive_weights``: the same, received over the collective transport: the worker
  joins the engine's channel to the trainer's publishing rank (gloo) itself.
- ``miles_canary``: the fingerprint of the canary of the publication loaded last.
- ``miles_reset_tensors``: random data under every named tensor (SGLang's ``reset_tensors``).
- ``miles_checksums``: fingerprints of the served tensors that keep the Hugging Face layout
  on this backend, by Hugging Face name, and the names of those that do not (vLLM on CPU
  repacks linear layers into kernel layouts; fused projections merge several tensors).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, load_file

from miles_events.device.fingerprint import tensor_fingerprint

CANARY_TENSOR = "miles_events.publication_canary"
"""As ``miles_events.rl.canary.CANARY_TENSOR`` (that module is not imported here)."""


class MilesWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's runner."""

    _miles_canary: torch.Tensor | None = None
    _miles_channels: Any = None
    """``ChannelReader`` of the collective transport: this worker's channels, formed once."""

    def _miles_load(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        canary = tensors.pop(CANARY_TENSOR, None)
        target = None
        if canary is not None:
            target = torch.empty_like(canary)
            # The canary is copied in the pass that feeds the weights to the model, so a
            # load that never iterated the payload leaves the previous canary.

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            if target is not None and canary is not None:
                target.copy_(canary)
            yield from tensors.items()

        self.model_runner.reload_weights(weights_iterator=weights())  # type: ignore[attr-defined]
        self.miles_refresh_shared_weights()
        if target is not None:
            self._miles_canary = target
        return {
            "num_tensors": len(tensors),
            "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        }

    def miles_refresh_shared_weights(self) -> list[str]:
        """Re-derive the kernel copies of every layer whose weight is another layer's (a
        tied LM head, which shares the embedding's): a reload processes only the layers
        whose weights it loaded, and on CPU a layer's processing packs a copy of its weight
        for its matrix product, so the tied head would go on multiplying by the weights it
        was first given. Returns the layers refreshed."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
        for name, module in model.named_modules():
            weight = module._parameters.get("weight")
            if weight is not None:
                holders.setdefault(id(weight), []).append((name, module))
        refreshed: list[str] = []
        for modules in holders.values():
            if len(modules) < 2:
                continue
            for name, module in modules:
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
                    refreshed.append(name)
        return refreshed

    def miles_push_weights(self, payload_b64: str) -> dict[str, Any]:
        """Load the safetensors bytes ``payload_b64`` (base64) into the served model."""
        return self._miles_load(dict(load(base64.b64decode(payload_b64))))

    def miles_receive_weights(self, ref_json: str, reader: str, timeout: str) -> dict[str, Any]:
        """Receive the weights ``ref_json`` (a ``DataRef`` of the ``collective`` transport)
        over channel ``reader`` (the engine's name) to the trainer's publishing rank, formed
        at the first load (gloo), and load them into the served model."""
        import msgspec

        from miles_events.transport.collective import ChannelReader, CollectiveSettings
        from schemas.data import DataRef

        ref = msgspec.json.decode(ref_json, type=DataRef)
        if MilesWorkerExtension._miles_channels is None:
            MilesWorkerExtension._miles_channels = ChannelReader(CollectiveSettings(timeout=float(timeout)))
        stream = MilesWorkerExtension._miles_channels.stream_buckets(ref, reader)
        if stream is None:
            raise ValueError(f"{ref.transport}:{ref.key} is not sent on request")
        return self._miles_load(dict(stream.assemble().tensors()))

    def miles_load_weights_from_dir(self, directory: str) -> dict[str, Any]:
        """Load every ``*.safetensors`` file of ``directory`` into the served model."""
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(directory).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        return self._miles_load(tensors)

    def miles_reset_tensors(self, names_json: str) -> dict[str, Any]:
        """Load random data (a fixed seed) under every Hugging Face name and shape in
        ``names_json``: SGLang's ``reset_tensors``, through vLLM's weight loading so that
        repacked and fused layers are overwritten too."""
        wanted: dict[str, list[int]] = json.loads(names_json)
        generator = torch.Generator().manual_seed(0)
        dtype = next(self.model_runner.get_model().parameters()).dtype  # type: ignore[attr-defined]
        tensors = {name: torch.randn(shape, generator=generator).to(dtype) for name, shape in wanted.items()}
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        self.miles_refresh_shared_weights()
        return {"num_tensors": len(tensors)}

    def miles_canary(self) -> str:
        """The fingerprint of the canary loaded last; "" before any."""
        return "" if self._miles_canary is None else tensor_fingerprint(self._miles_canary)

    def miles_checksums(self, names_json: str) -> dict[str, Any]:
        """Fingerprints of the served tensors named in ``names_json`` (a JSON object of
        Hugging Face name -> shape) that vLLM holds under the same name and shape.

        Returns ``{"checksums": {name: fingerprint}, "unreadable": [names]}``: a name is
        unreadable when vLLM holds no tensor of that name and shape (fused projections
        such as ``qkv_proj``/``gate_up_proj``), or holds it in another layout (linear
        weights repacked on CPU read back empty or reshaped).
        """
        wanted: dict[str, list[int]] = json.loads(names_json)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        served = dict(model.named_parameters())
        served.update(dict(model.named_buffers()))
        checksums: dict[str, str] = {}
        unreadable: list[str] = []
        for name, shape in wanted.items():
            tensor = _served_view(model, served, name, wanted)
            if (
                tensor is None
                or list(tensor.shape) != list(shape)
                or tensor.numel() == 0
                or _repacked(model, name)
            ):
                unreadable.append(name)
                continue
            checksums[name] = tensor_fingerprint(tensor.detach().to("cpu").contiguous())
        return {"checksums": checksums, "unreadable": sorted(unreadable)}


_FUSED_BIASES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}


def _served_view(
    model: torch.nn.Module, served: dict[str, torch.Tensor], name: str, wanted: dict[str, list[int]]
) -> torch.Tensor | None:
    """The part of what vLLM serves that holds the Hugging Face tensor ``name``, if any.

    Two layouts are undone: an embedding (or LM head) whose vocabulary vLLM pads to a
    multiple of its tile keeps the real rows first; the q/k/v biases fused into
    ``qkv_proj.bias`` lie one after another in that order.
    """
    tensor = served.get(name)
    if tensor is not None:
        shape = wanted[name]
        if (
            tensor.dim() == len(shape) >= 1
            and list(tensor.shape[1:]) == shape[1:]
            and tensor.shape[0] > shape[0]
        ):
            from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

            module_name = name.rpartition(".")[0]
            if isinstance(model.get_submodule(module_name), VocabParallelEmbedding):
                return tensor[: shape[0]]
        return tensor
    prefix, _, rest = name.rpartition(".")  # "model.layers.0.self_attn.q_proj", "bias"
    parent, _, projection = prefix.rpartition(".")
    if rest != "bias" or projection not in _FUSED_BIASES:
        return None
    fused_name, position = _FUSED_BIASES[projection]
    fused = served.get(f"{parent}.{fused_name}.bias")
    parts = [wanted.get(f"{parent}.{p}.bias") for p in ("q_proj", "k_proj", "v_proj")]
    if fused is None or any(part is None or len(part) != 1 for part in parts):
        return None
    sizes = [part[0] for part in parts if part is not None]
    if sum(sizes) != fused.numel():
        return None
    start = sum(sizes[:position])
    return fused[start : start + sizes[position]]


def _repacked(model: torch.nn.Module, name: str) -> bool:
    """Whether the parameter ``name`` belongs to a linear layer whose kernel keeps its own
    packed copy of the weight (the parameter then no longer reflects what is served)."""
    module_name, _, attribute = name.rpartition(".")
    if attribute != "weight":
        return False
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return True
    from vllm.model_executor.layers.linear import LinearBase

    # A linear layer's weight goes through its quant method (unquantised too), which on CPU
    # may swap it for a packed kernel copy; only its bias keeps the layout it was loaded in.
    return isinstance(module, LinearBase) and attribute == "weight"
