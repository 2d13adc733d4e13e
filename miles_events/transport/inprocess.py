"""The ``inprocess`` transport: objects kept in this process (the local runtime's default).

Both ends share one store per run, module-level so that every actor of a local run (one
process) sees the same objects. Buckets and states are handed over as they are, tensors
copied once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_events.transport.base import Reader, Stager, Transport
from schemas.data import DataRef

if TYPE_CHECKING:
    import torch

    from miles_events.device.buckets import Buckets

# Objects of the in-process transport, by run id then key.
_IN_PROCESS: dict[str, dict[str, object]] = {}


def _store(run_id: str) -> dict[str, object]:
    return _IN_PROCESS.setdefault(run_id, {})


@dataclass(frozen=True)
class _StagedState:
    """A state kept in process (told apart from the other objects kept)."""

    state: Any


def _state_bytes(state: Any) -> int:
    from miles_events.device.host_copy import map_tensors

    sizes: list[int] = []

    def count(tensor: Any) -> Any:
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    map_tensors(state, count)
    return sum(sizes)


class InProcessStager(Stager):
    name = "inprocess"

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], owner: str) -> DataRef:
        copy = {name: t.detach().clone() for name, t in tensors.items()}
        _store(self.run_id)[key] = copy
        return DataRef(self.name, key, owner, sum(t.numel() * t.element_size() for t in copy.values()))

    def put_buckets(self, key: str, buckets: Buckets, owner: str) -> DataRef:
        # Handed over, not copied: the caller packed them for this publication alone.
        _store(self.run_id)[key] = buckets
        return DataRef(self.name, key, owner, buckets.num_bytes)

    def put_bytes(self, key: str, data: bytes, owner: str) -> DataRef:
        _store(self.run_id)[key] = bytes(data)
        return DataRef(self.name, key, owner, len(data))

    def put_state(self, key: str, state: Any, owner: str) -> DataRef:
        # Handed over as it is: nothing in this process needs it serialised.
        _store(self.run_id)[key] = _StagedState(state)
        return DataRef(self.name, key, owner, _state_bytes(state))

    def free(self, ref: DataRef) -> None:
        _store(self.run_id).pop(ref.key, None)


class InProcessReader(Reader):
    name = "inprocess"

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]:
        value = self._get(ref)
        if isinstance(value, dict):
            return value
        buckets = self.get_buckets(ref)  # the only other kind of tensors kept
        assert buckets is not None
        return buckets.tensors()

    def get_buckets(self, ref: DataRef) -> Buckets | None:
        from miles_events.device.buckets import Buckets

        value = self._get(ref)
        return value if isinstance(value, Buckets) else None

    def get_bytes(self, ref: DataRef) -> bytes:
        value = self._get(ref)
        assert isinstance(value, bytes)
        return value

    def get_state(self, ref: DataRef) -> Any:
        value = self._get(ref)
        assert isinstance(value, _StagedState)
        return value.state

    def _get(self, ref: DataRef) -> object:
        try:
            return _store(self.run_id)[ref.key]
        except KeyError:
            raise KeyError(f"in-process data {ref.key!r} is gone (freed, or from another process)") from None


class InProcessTransport(Transport):
    name = "inprocess"

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id, InProcessStager(run_id), InProcessReader(run_id))

    def close(self) -> None:
        super().close()
        _IN_PROCESS.pop(self.run_id, None)
