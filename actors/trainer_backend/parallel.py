"""How the trainer's ranks share a model: one process, or a torch.distributed process group.

The PyTorch backend (``torch_backend.py``) trains the same way on one rank or many; what
differs is behind ``Parallel``:

- ``OneProcess`` (``trainer.sharding = "none"``, one rank): the model as it is, no
  collective. Today's single-process trainer.
- ``ProcessGroup`` (``fsdp2`` or ``ddp``): the ranks of one ``torch.distributed`` process
  group (gloo on CPU, NCCL on GPU), rendezvous through a TCP store whose port the Trainer
  actor holds. ``fsdp2`` shards every parameter, its gradient and its optimizer state across
  the ranks (``fully_shard`` on each decoder layer, then on the forward's root module, which
  owns the rest: embeddings, final norm, output head); ``ddp`` keeps a whole replica per rank
  and all-reduces gradients.

A rollout is split by samples: each optimizer step's samples are cut into N contiguous
parts, one per rank (advantages were computed over the whole rollout before). A rank with
fewer micro-batches than another runs empty ones (its first sample, every token masked), so
that every rank runs the same forwards and backwards and so the same collectives. Each
rank divides its loss by the token count of the whole step, which every rank computes from
the whole rollout it was handed, and multiplies it by N, since both FSDP2 and DDP average
gradients over the ranks: the ranks' gradients then add up to the gradient of the
undivided step. Gradient clipping uses the global norm (FSDP2's gradients are sharded
DTensors, whose norm is reduced across the ranks; DDP's are whole after its all-reduce).

Every collective has the group's timeout (``trainer.collective_timeout``): a rank that dies
or hangs makes the others' collective fail within it, never wait for ever.

State crosses rank counts as one full, name-keyed form: weights as Hugging Face tensors,
the optimizer's state keyed by parameter name (``torch.distributed.checkpoint``'s full
optimizer state dict), which any number of ranks loads: rank 0 reads it and broadcasts.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any, Literal, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from miles_events.rl.weights import split_tied

Sharding = Literal["none", "fsdp2", "ddp"]


def share(indices: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous part of ``indices`` (parts differ in length by at most one)."""
    count = len(indices)
    return indices[rank * count // world_size : (rank + 1) * count // world_size]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's (a DTensor's) part on this rank; any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    local: torch.Tensor = to_local() if to_local is not None else tensor
    return local


def by_name(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer ``state_dict()`` keyed by parameter index (``torch.optim``'s own form, which
    checkpoints written before held) keyed by parameter name instead: index ``i`` is
    ``names[i]``, the optimizer's parameters in order. A state keyed by name is returned as is."""
    groups = optimizer_state.get("param_groups", [])
    if all(isinstance(p, str) for group in groups for p in group["params"]):
        return optimizer_state
    return {
        "state": {names[int(index)]: value for index, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(index)] for index in group["params"]]} for group in groups
        ],
    }


def by_index(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``by_name``'s inverse: a state keyed by parameter name keyed by index, as
    ``torch.optim.Optimizer.load_state_dict`` takes it, each group's parameters in the
    optimizer's order."""
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(
        {str(p) for group in optimizer_state["param_groups"] for p in group["params"]} - set(index)
    )
    if unknown:
        raise ValueError(f"the optimizer state names parameters the model does not have: {unknown[:5]}")
    # In the optimizer's own order: ``load_state_dict`` pairs a group's parameters by position
    # (a state converted from another backend lists them in that backend's order).
    return {
        "state": {index[name]: value for name, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": sorted(index[name] for name in group["params"])}
            for group in optimizer_state["param_groups"]
        ],
    }


class Parallel:
    """One process: the model trained as it is."""

    sharding: Sharding = "none"
    rank = 0
    world_size = 1

    @property
    def group_device(self) -> torch.device | None:
        """The device the group's collectives run on (None: the backend chooses)."""
        return None

    @property
    def sharded(self) -> bool:
        """Whether the model's modules are wrapped for a process group (forwards go through
        the root module given to ``wrap``)."""
        return False

    def wrap(self, root: torch.nn.Module, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        """``root`` (whose forward runs ``model``) ready to train on this group's ranks."""
        return root

    def share(self, indices: list[int]) -> list[int]:
        return indices

    def sum(self, values: list[float]) -> list[float]:
        """The sum of ``values`` over the ranks, element by element."""
        return values

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank."""
        return flag

    def no_sync(self, module: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[object]:
        """The context of a backward that is not the step's last (DDP defers its all-reduce)."""
        return contextlib.nullcontext()

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole state dict on rank 0 (names as in ``model.state_dict()``); ``{}``
        on the other ranks."""
        return model.state_dict()

    def load_full_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Load ``full_weights``' form, given on rank 0 (the others pass ``{}``), whose
        names and shapes were checked against the model's (a tied tensor is restored through
        the name it is tied to)."""
        live, _tied = split_tied(model.state_dict())
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(weights[name])

    def optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> dict[str, Any]:
        """The optimizer's whole state keyed by parameter name (``names``: the optimizer's
        parameters in order), on rank 0; ``{}`` elsewhere."""
        return by_name(optimizer.state_dict(), names)

    def load_optimizer_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        names: list[str],
    ) -> None:
        """Load ``optimizer_state``'s form, given on rank 0 (the others pass ``{}``); a state
        without entries (saved before the first step) leaves the optimizer fresh."""
        optimizer.load_state_dict(by_index(by_name(state, names), names))

    def close(self) -> None:
        """Leave the process group, if any."""


class ProcessGroup(Parallel):
    """This process as rank ``rank`` of ``world_size``, sharding as ``sharding`` says."""

    def __init__(
        self,
        sharding: Literal["fsdp2", "ddp"],
        rank: int,
        world_size: int,
        store_address: tuple[str, int],
        timeout_seconds: float,
        device: torch.device,
        rendezvous_seconds: float | None = None,
    ) -> None:
        """``timeout_seconds`` bounds each collective; ``rendezvous_seconds`` (default: the
        same) the ranks' meeting at start."""
        import torch.distributed as dist

        self.sharding = sharding
        self.rank = rank
        self.world_size = world_size
        self.device = device
        timeout = datetime.timedelta(seconds=timeout_seconds)
        meeting = datetime.timedelta(seconds=rendezvous_seconds or timeout_seconds)
        host, port = store_address
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in its __all__

        store = TCPStore(host, port, world_size, is_master=False, timeout=meeting)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=meeting,
        )
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device.type, (world_size,))
        # Met: from here each collective has the collective timeout.
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timeout, None)

    @property
    def sharded(self) -> bool:
        return True

    @property
    def group_device(self) -> torch.device:
        return self.device

    def wrap(self, root: torch.nn.Module, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        if self.sharding == "ddp":
            if not trainable or self.world_size == 1:
                return root  # a frozen replica (the KL reference), or one rank: nothing to reduce
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(root, device_ids=ids, broadcast_buffers=False)
        from torch.distributed.fsdp import fully_shard

        # One unit per decoder layer (its parameters gathered only while it runs), then the
        # root's: what no layer owns (embeddings, final norm, output head, tied or not).
        # On one rank there is nothing to save by freeing the gathered parameters between
        # uses: they stay gathered from the first forward to the optimizer step.
        reshard = self.world_size > 1
        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=self.mesh, reshard_after_forward=reshard)
        fully_shard(root, mesh=self.mesh, reshard_after_forward=reshard)
        return root

    def share(self, indices: list[int]) -> list[int]:
        return share(indices, self.rank, self.world_size)

    def sum(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return [float(v) for v in tensor.tolist()]

    def any(self, flag: bool) -> bool:
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def no_sync(self, module: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[object]:
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if self.sharding == "ddp" and not last and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        if self.world_size == 1 and not last and isinstance(module, FSDPModule):
            # One rank: gradients are reduced once per step, the parameters kept gathered
            # (several ranks reduce-scatter each micro-batch's, holding only their shard).
            return _deferred(module)
        return contextlib.nullcontext()

    def _options(self, broadcast_from_rank0: bool = False, strict: bool = True) -> StateDictOptions:
        return StateDictOptions(
            full_state_dict=True,
            cpu_offload=self.device.type == "cpu",
            broadcast_from_rank0=broadcast_from_rank0,
            strict=strict,
        )

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if self.sharding == "ddp":
            return model.state_dict() if self.rank == 0 else {}
        weights = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=self._options()))
        return weights if self.rank == 0 else {}

    def load_full_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(
            model,
            cast(dict[str, Any], weights),
            options=self._options(broadcast_from_rank0=True, strict=False),
        )

    def optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> dict[str, Any]:
        if not optimizer.state:
            # Before the first step: torch.distributed.checkpoint would take a step of zeros
            # to create the state, and the next real step would count as the second.
            state = by_name(optimizer.state_dict(), names)
        else:
            state = get_optimizer_state_dict(model, optimizer, options=self._options())
        return state if self.rank == 0 else {}

    def load_optimizer_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        names: list[str],
    ) -> None:
        # Whether rank 0 has a state to send: the others were handed none.
        if not self.any(bool(state.get("state"))):
            return
        set_optimizer_state_dict(model, optimizer, state, options=self._options(broadcast_from_rank0=True))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _deferred(module: Any) -> Iterator[None]:
    """A backward of an FSDP2 module that neither reduces its gradients nor frees its
    gathered parameters (the step's last backward does both)."""
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
