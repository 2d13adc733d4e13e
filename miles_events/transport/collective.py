"""The ``collective`` transport: weights broadcast from the trainer's publishing rank to each
engine over a ``torch.distributed`` process group (NCCL between GPUs, gloo otherwise), in
flat buckets of at most ``publisher.bucket_bytes``; across GPUs and hosts, as slime and
miles publish.

Channels. Each reader (an engine, by name) has a channel of its own to the publishing rank:
a process group of two, the publishing rank as rank 0, formed at the reader's first load (the
run's first publication, at start; a restarted engine's restore) and formed again when an
engine of the same name joins anew (it was restarted) or a broadcast on it failed. One group
per engine, rather than slime's one group of every engine, keeps engines apart: an engine
that dies, hangs or restarts costs its own channel, the others go on, and a restored engine
is sent the weights alone. The price is one broadcast per engine instead of one for all:
the publishing rank's link carries the weights once per engine.

Rendezvous. ``put_buckets`` keeps the staged buckets in the publishing process and hosts a
``TCPStore`` there (its address is the reference's ``address``). A reader joins by adding
itself to the store (``channel/<n>``: its name and device), the publisher answers with the
group's backend, and both build the group on the store under the channel's prefix.

A load is asked for by the reader: it writes the key under ``channel/<n>/ask/<i>``, and the
channel's thread in the publishing process broadcasts a header (the buckets' layouts, the
chunks, or why the key cannot be sent: it was freed) and then every chunk: bucket ``b``'s
bytes ``[start, end)``, at most ``bucket_bytes`` each. The reader places each chunk as it
lands (``BucketStream.receive``): an engine whose weights share the layouts receives them
straight into its own buffers, so no more than a chunk is in flight beside what it serves.

Every broadcast and every wait on the store has ``publisher.broadcast_timeout``: a peer
that died or hangs turns into a ``CollectiveError`` naming the channel, key and chunk on
the reader (its engine's load fails, and the Publisher says so with ``PublicationFailed``)
and drops the channel on both sides; the next load forms a new one.

Everything that is not a set of weight buckets (rollout batches, the Saver's train state,
weights put as tensors) goes through shared memory (``miles_events.transport.shm``), as
the ``cuda_ipc`` transport does: those never leave the host.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from miles_events.device.buckets import byte_view
from miles_events.transport.base import BucketStream, FilesTransport
from miles_events.transport.shm import ShmFiles, ShmReader, ShmStager
from schemas.data import BucketLayout, DataRef

if TYPE_CHECKING:
    import torch

    from miles_events.device.buckets import Buckets
    from schemas.config import Config

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20
DEFAULT_TIMEOUT = 60.0
IDLE = datetime.timedelta(days=1)
"""How long a thread of the publishing end waits on the store at once for a reader to
join or ask (it is woken to stop)."""


class CollectiveError(RuntimeError):
    """A broadcast or a wait on the rendezvous store failed or timed out; one line."""


@dataclass(frozen=True)
class CollectiveSettings:
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout: float = DEFAULT_TIMEOUT
    host: str | None = None
    """The address readers reach the publishing process at; None: this host's outbound one."""

    @classmethod
    def of(cls, config: Config | None) -> CollectiveSettings:
        if config is None:
            return cls()
        publisher = config.publisher
        return cls(publisher.bucket_bytes, publisher.broadcast_timeout, publisher.collective_host)


class Hello(msgspec.Struct, frozen=True):
    """A reader joining: its name (an engine's) and where it places what lands.

    ``tensors``: the receivers are another process's ranks (an SGLang server's, ``ranks`` of
    them) that form the group the way SGLang's ``init_weights_update_group`` does and take
    each tensor in a broadcast of its own (SGLang's ``update_weights_from_distributed``);
    the reader only drives them."""

    name: str
    device: str
    protocol: Literal["chunks", "tensors"] = "chunks"
    ranks: int = 1


class Rendezvous(msgspec.Struct, frozen=True):
    """Where the receivers of a ``tensors`` channel form its group with the publishing rank
    (rank 0): SGLang's ``/init_weights_update_group`` fields."""

    host: str
    port: int
    world_size: int
    group_name: str
    backend: str


class Ask(msgspec.Struct, frozen=True):
    key: str
    skip: tuple[str, ...] = ()
    """``tensors``: names left out of the broadcasts (the receivers do not know them)."""


class Chunk(msgspec.Struct, frozen=True, array_like=True):
    bucket: int
    start: int
    """First byte of the bucket's buffer."""
    end: int


class Header(msgspec.Struct, frozen=True):
    key: str
    layouts: tuple[BucketLayout, ...] = ()
    chunks: tuple[Chunk, ...] = ()
    error: str = ""


def plan_chunks(layouts: tuple[BucketLayout, ...], bucket_bytes: int) -> tuple[Chunk, ...]:
    """Every bucket's bytes, in order, cut into pieces of at most ``bucket_bytes``."""
    from miles_events.device.buckets import _torch_dtype

    chunks: list[Chunk] = []
    for index, layout in enumerate(layouts):
        size = layout.numel * _torch_dtype(layout.dtype).itemsize
        chunks.extend(
            Chunk(index, start, min(start + bucket_bytes, size)) for start in range(0, size, bucket_bytes)
        )
    return tuple(chunks)


def outbound_host() -> str:
    """This host's address on its default route (no packet is sent); loopback without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def connect(address: str, timeout: float) -> Any:
    """A connection of its own to the rendezvous store at ``address`` (``host:port``)."""
    host, _, port = address.rpartition(":")
    try:
        return _dist().TCPStore(host, int(port), is_master=False, timeout=_timedelta(timeout))
    except (RuntimeError, ValueError) as error:
        raise CollectiveError(
            f"cannot reach the publishing rank at {address}: {_first_line(error)}"
        ) from None


def _dist() -> Any:
    """``torch.distributed``, whose stores and process groups its ``__all__`` leaves out."""
    import torch.distributed

    return torch.distributed


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def new_group(store: Any, rank: int, backend: str, timeout: float) -> Any:
    """A process group of two on ``store`` (a prefix of the rendezvous store), built directly,
    so that one process may hold the groups of several channels (NCCL: on the current GPU)."""
    dist = _dist()

    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timedelta(timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, _timedelta(timeout))


def sglang_group(
    store: Any, rank: int, world_size: int, group_name: str, backend: str, timeout: float
) -> Any:
    """The group SGLang's ranks form in ``/init_weights_update_group``: torch's own helper on
    the rendezvous store behind a ``PrefixStore`` of the group's name, as SGLang's
    ``init_custom_process_group`` builds it, here for the publishing rank (rank 0, whose
    store hosts the rendezvous)."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    helper: Any = _new_process_group_helper  # its group_name is a typed alias of str
    group, _ = helper(
        world_size, rank, [], Backend(backend), _dist().PrefixStore(group_name, store),
        group_name=group_name, backend_options=None, timeout=_timedelta(timeout),
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _broadcast(group: Any, tensor: torch.Tensor, timeout: float, what: str) -> None:
    try:
        group.broadcast([tensor], _broadcast_options()).wait(_timedelta(timeout))
    except RuntimeError as error:
        raise CollectiveError(f"{what}: {_first_line(error)}") from None


def _broadcast_options() -> Any:
    dist = _dist()

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


def _send_bytes(group: Any, data: bytes, timeout: float, what: str) -> None:
    import torch

    _broadcast(group, torch.tensor([len(data)], dtype=torch.int64), timeout, what)
    _broadcast(group, torch.frombuffer(bytearray(data), dtype=torch.uint8), timeout, what)


def _receive_bytes(group: Any, timeout: float, what: str) -> bytes:
    import torch

    length = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, length, timeout, what)
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    _broadcast(group, data, timeout, what)
    return data.numpy().tobytes()


# --- the publishing end ------------------------------------------------------------------------


@dataclass
class Channel:
    """The publishing end of one reader's channel: its thread serves the reader's asks."""

    number: int
    hello: Hello
    backend: str
    asks: int = 0
    """The index of the ask its thread waits for (or serves)."""
    rendezvous: Any = None
    """``tensors``: the store the receivers form the group on (hosted here)."""
    group_name: str = ""
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None

    @property
    def prefix(self) -> str:
        return f"channel/{self.number}"


class ChannelServer:
    """Hosts the rendezvous store and one thread per channel, in the publishing process.

    Each thread waits on the store through a connection of its own (a wait holds its
    connection), for as long as it takes; stopping one writes the key it waits for."""

    def __init__(self, settings: CollectiveSettings, held: Callable[[str], Buckets | None]) -> None:
        dist = _dist()

        self.settings = settings
        self.held = held
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=IDLE)
        self.address = f"{settings.host or outbound_host()}:{self.store.port}"
        self.device: torch.device | None = None
        """Where the staged buckets are: NCCL only between a GPU here and a GPU there."""
        self.channels: dict[str, Channel] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._next_join = 1
        self._threads: list[threading.Thread] = []
        self._spawn(self._watch, "collective-joins")

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def _client(self) -> Any:
        dist = _dist()

        return dist.TCPStore("127.0.0.1", self.store.port, is_master=False, timeout=IDLE)

    def _wait(self, client: Any, key: str, stopped: Callable[[], bool]) -> bytes | None:
        """The value of ``key`` once written; None once ``stopped``."""
        while not stopped():
            try:
                client.wait([key])
            except RuntimeError:  # DistStoreError: nothing for IDLE; look again
                continue
            return None if stopped() else bytes(client.get(key))
        return None

    def _watch(self) -> None:
        """Start a channel for every reader that joins; stop the one it replaces."""
        client = self._client()
        while (value := self._wait(client, f"join/{self._next_join}", lambda: self._closed)) is not None:
            number, self._next_join = self._next_join, self._next_join + 1
            try:
                hello = msgspec.msgpack.decode(value, type=Hello)
            except msgspec.DecodeError:
                logger.warning("collective: the reader of channel %d sent an unreadable hello", number)
                continue
            self._start(number, hello)

    def _start(self, number: int, hello: Hello) -> None:
        dist = _dist()

        here = self.device.type if self.device is not None else "cpu"
        nccl = hello.device == "cuda" and here == "cuda" and dist.is_nccl_available()
        channel = Channel(number, hello, "nccl" if nccl else "gloo")
        with self._lock:
            previous = self.channels.get(hello.name)
            self.channels[hello.name] = channel
        if previous is not None:  # its engine restarted, or a broadcast on it failed
            self._stop(previous)
        if hello.protocol == "tensors":
            # The receivers' own rendezvous, as SGLang's ranks make it: a store hosted here.
            channel.rendezvous = dist.TCPStore(
                "0.0.0.0",
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=_timedelta(self.settings.timeout),
            )
            host = self.address.rpartition(":")[0]
            # Unique in every receiving process (torch keeps a process's group names).
            channel.group_name = f"miles-{os.getpid()}-{number}"
            point = Rendezvous(
                host, channel.rendezvous.port, 1 + hello.ranks, channel.group_name, channel.backend
            )
            self.store.set(f"{channel.prefix}/rendezvous", msgspec.msgpack.encode(point))
        self.store.set(f"{channel.prefix}/backend", channel.backend)
        channel.thread = self._spawn(self._serve, f"collective-{hello.name}", channel)

    def _stop(self, channel: Channel) -> None:
        with channel.lock:
            channel.stopped = True
            self.store.set(f"{channel.prefix}/ask/{channel.asks}", b"")  # wakes its wait

    def _serve(self, channel: Channel) -> None:
        dist = _dist()

        client = self._client()
        if channel.backend == "nccl" and self.device is not None:
            import torch

            torch.cuda.set_device(self.device)  # a thread's own: NCCL works on its current GPU
        try:
            if channel.hello.protocol == "tensors":
                world = 1 + channel.hello.ranks
                group = sglang_group(
                    channel.rendezvous, 0, world, channel.group_name, channel.backend, self.settings.timeout
                )
            else:
                group = new_group(
                    dist.PrefixStore(f"{channel.prefix}/group", client),
                    0,
                    channel.backend,
                    self.settings.timeout,
                )
        except RuntimeError as error:
            logger.warning(
                "collective: channel %s (%s) not formed: %s", channel.number, channel.hello.name, error
            )
            return
        while True:
            with channel.lock:
                ask_key = f"{channel.prefix}/ask/{channel.asks}"
            value = self._wait(client, ask_key, lambda: channel.stopped or self._closed)
            if value is None:
                break
            with channel.lock:
                channel.asks += 1
            try:
                ask = msgspec.msgpack.decode(value, type=Ask)
                if channel.hello.protocol == "tensors":
                    self._send_tensors(group, channel, ask, client)
                else:
                    self._send(group, channel, ask.key)
            except (CollectiveError, msgspec.DecodeError) as error:
                logger.warning(
                    "collective: channel %s (%s) dropped: %s", channel.number, channel.hello.name, error
                )
                break
        with self._lock:
            if self.channels.get(channel.hello.name) is channel:
                del self.channels[channel.hello.name]

    def _send(self, group: Any, channel: Channel, key: str) -> None:
        import torch

        buckets = self.held(key)
        timeout = self.settings.timeout
        what = f"channel {channel.hello.name}: {key}"
        if buckets is None:
            header = Header(key, error=f"{key} is not staged here (freed, or staged by an earlier trainer)")
        else:
            header = Header(key, buckets.layouts, plan_chunks(buckets.layouts, self.settings.bucket_bytes))
        _send_bytes(group, msgspec.msgpack.encode(header), timeout, f"{what}: header")
        if buckets is None:
            return
        gpu_wire = channel.backend == "nccl"
        for number, chunk in enumerate(header.chunks):
            piece = byte_view(buckets.buffers[chunk.bucket])[chunk.start : chunk.end]
            if piece.device.type == "cuda" and not gpu_wire:
                piece = piece.cpu()
            elif gpu_wire and piece.device.type != "cuda":
                piece = piece.to(torch.device("cuda", torch.cuda.current_device()))
            _broadcast(group, piece, timeout, f"{what}: chunk {number + 1}/{len(header.chunks)}")

    def _send_tensors(self, group: Any, channel: Channel, ask: Ask, client: Any) -> None:
        """The header to the store (the reader drives receivers that are not this group's
        rank 1), then every tensor but ``ask.skip`` in a broadcast of its own, in the
        header's order (SGLang's receive: one ``broadcast`` a tensor, by bucket request)."""
        buckets = self.held(ask.key)
        what = f"channel {channel.hello.name}: {ask.key}"
        if buckets is None:
            header = Header(
                ask.key, error=f"{ask.key} is not staged here (freed, or staged by an earlier trainer)"
            )
        else:
            header = Header(ask.key, buckets.layouts)
        client.set(f"{channel.prefix}/header/{channel.asks - 1}", msgspec.msgpack.encode(header))
        if buckets is None:
            return
        sent = [
            (slot.name, buffer[slot.offset : slot.offset + slot.numel])
            for layout, buffer in zip(buckets.layouts, buckets.buffers, strict=True)
            for slot in layout.slots
            if slot.name not in ask.skip
        ]
        for number, (name, tensor) in enumerate(sent):
            if channel.backend == "nccl" and tensor.device.type != "cuda":
                import torch

                tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            _broadcast(
                group, tensor, self.settings.timeout, f"{what}: tensor {number + 1}/{len(sent)} ({name})"
            )

    def close(self) -> None:
        """Stop every thread: those waiting return at once, one in a broadcast once it ends."""
        self._closed = True
        with self._lock:
            channels = list(self.channels.values())
        for channel in channels:
            self._stop(channel)
        self.store.set(f"join/{self._next_join}", b"")
        for thread in self._threads:
            thread.join(timeout=1.0)


class CollectiveStager(ShmStager):
    """Keeps staged weight buckets and serves them over the channels; the rest goes to shm."""

    def __init__(self, files: ShmFiles, settings: CollectiveSettings) -> None:
        super().__init__(files, name="collective")
        self.settings = settings
        self._held: dict[str, Buckets] = {}
        self._lock = threading.Lock()
        self._server: ChannelServer | None = None

    def _held_buckets(self, key: str) -> Buckets | None:
        with self._lock:
            return self._held.get(key)

    def put_buckets(self, key: str, buckets: Buckets, owner: str) -> DataRef:
        if self._server is None:
            self._server = ChannelServer(self.settings, self._held_buckets)
        self._server.device = buckets.device
        with self._lock:
            self._held[key] = buckets
        return DataRef(self.name, key, owner, buckets.tensor_bytes, address=self._server.address)

    def free(self, ref: DataRef) -> None:
        with self._lock:
            held = self._held.pop(ref.key, None)
        if held is None:
            super().free(ref)

    def close(self) -> None:
        with self._lock:
            self._held.clear()
        if self._server is not None:
            self._server.close()
            self._server = None


# --- the reading end ---------------------------------------------------------------------------


class ReaderChannel:
    """The reading end of one channel (rank 1 of its group)."""

    def __init__(self, store: Any, number: int, group: Any, backend: str) -> None:
        self.store = store
        self.number = number
        self.group = group
        self.backend = backend
        self.asks = 0
        self.lock = threading.Lock()


class ChannelReader:
    """The reading end's channels, one per reader name and publishing rank, and the loads
    over them; what a process that reads nothing else holds (a vLLM worker)."""

    def __init__(self, settings: CollectiveSettings) -> None:
        self.settings = settings
        self._channels: dict[tuple[str, str], ReaderChannel] = {}
        self._lock = threading.Lock()

    def _channel(self, address: str, name: str, device: torch.device) -> ReaderChannel:
        """``name``'s channel to the publishing rank at ``address``, formed where it has none."""
        dist = _dist()

        with self._lock:
            channel = self._channels.get((address, name))
            if channel is not None:
                return channel
            if device.type == "cuda":
                import torch

                torch.cuda.set_device(device)  # NCCL forms the group on the current GPU
            store = connect(address, self.settings.timeout)  # the channel's own connection
            number = store.add("channels", 1)
            store.set(f"join/{number}", msgspec.msgpack.encode(Hello(name, device.type)))
            try:
                store.wait([f"channel/{number}/backend"])
                backend = store.get(f"channel/{number}/backend").decode()
                group = new_group(
                    dist.PrefixStore(f"channel/{number}/group", store), 1, backend, self.settings.timeout
                )
            except RuntimeError as error:
                raise CollectiveError(
                    f"channel {name} to {address} not formed: {_first_line(error)}"
                ) from None
            channel = ReaderChannel(store, number, group, backend)
            self._channels[(address, name)] = channel
            return channel

    def _drop(self, address: str, name: str, channel: ReaderChannel) -> None:
        with self._lock:
            if self._channels.get((address, name)) is channel:
                del self._channels[(address, name)]

    def stream_buckets(
        self, ref: DataRef, reader: str = "", device: torch.device | None = None
    ) -> BucketStream | None:
        """The buckets behind ``ref`` as they land, over the channel of ``reader`` (an
        engine's name; default: this process); None for data that is not weight buckets."""
        import torch

        if not ref.address:
            return None
        device = device or torch.device("cpu")
        name = reader or f"pid-{os.getpid()}"
        channel = self._channel(ref.address, name, device)
        what = f"channel {name}: {ref.key}"
        if not channel.lock.acquire(timeout=self.settings.timeout):
            self._drop(ref.address, name, channel)
            raise CollectiveError(f"{what}: the channel's previous load was never received")
        try:
            channel.store.set(
                f"channel/{channel.number}/ask/{channel.asks}", msgspec.msgpack.encode(Ask(ref.key))
            )
            channel.asks += 1
            header = msgspec.msgpack.decode(
                _receive_bytes(channel.group, self.settings.timeout, f"{what}: header"), type=Header
            )
        except CollectiveError:
            self._drop(ref.address, name, channel)
            channel.lock.release()
            raise
        if header.error:
            channel.lock.release()
            raise CollectiveError(f"{what}: {header.error}")

        def chunks(into: Callable[[int, int, int], torch.Tensor]) -> None:
            try:
                for number, chunk in enumerate(header.chunks):
                    target = into(chunk.bucket, chunk.start, chunk.end)
                    _receive_into(
                        channel, target, f"{what}: chunk {number + 1}/{len(header.chunks)}", self.settings
                    )
            except CollectiveError:
                self._drop(ref.address, name, channel)
                raise
            finally:
                channel.lock.release()

        return BucketStream(header.key, header.layouts, chunks)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            taken = channel.lock.acquire(timeout=1.0)  # after a load in progress
            channel.group.shutdown()
            if taken:
                channel.lock.release()


@dataclass
class DrivenChannel:
    store: Any
    number: int
    rendezvous: Rendezvous
    asks: int = 0


class DrivenReceivers:
    """The reading end for receivers in another process (an SGLang server's ranks): joins a
    ``tensors`` channel for them, says where they form its group (``Rendezvous``), asks for
    each publication and reads its header; they take each tensor themselves."""

    def __init__(self, settings: CollectiveSettings) -> None:
        self.settings = settings
        self._channels: dict[tuple[str, str], DrivenChannel] = {}

    def join(self, address: str, name: str, ranks: int, device: str) -> tuple[Rendezvous, bool]:
        """The rendezvous of ``name``'s channel to ``address``, and whether it was joined now
        (its receivers are yet to form the group)."""
        channel = self._channels.get((address, name))
        if channel is not None:
            return channel.rendezvous, False
        store = connect(address, self.settings.timeout)
        try:
            number = store.add("channels", 1)
            store.set(f"join/{number}", msgspec.msgpack.encode(Hello(name, device, "tensors", ranks)))
            store.wait([f"channel/{number}/rendezvous"])
            rendezvous = msgspec.msgpack.decode(store.get(f"channel/{number}/rendezvous"), type=Rendezvous)
        except RuntimeError as error:
            raise CollectiveError(f"channel {name} to {address} not formed: {_first_line(error)}") from None
        self._channels[(address, name)] = DrivenChannel(store, number, rendezvous)
        return rendezvous, True

    def ask(self, address: str, name: str, key: str, skip: tuple[str, ...] = ()) -> Header:
        """Ask for ``key`` on ``name``'s channel: the header, once the publishing rank is about
        to broadcast its tensors (all but ``skip``, in the header's order)."""
        channel = self._channels[(address, name)]
        prefix = f"channel/{channel.number}"
        try:
            channel.store.set(f"{prefix}/ask/{channel.asks}", msgspec.msgpack.encode(Ask(key, skip)))
            channel.store.wait([f"{prefix}/header/{channel.asks}"])
            header = msgspec.msgpack.decode(channel.store.get(f"{prefix}/header/{channel.asks}"), type=Header)
        except RuntimeError as error:
            self.drop(address, name)
            raise CollectiveError(f"channel {name}: {key}: header: {_first_line(error)}") from None
        channel.asks += 1
        if header.error:
            raise CollectiveError(f"channel {name}: {key}: {header.error}")
        return header

    def drop(self, address: str, name: str) -> None:
        """Forget ``name``'s channel: the next load joins anew (its receivers form a new group)."""
        self._channels.pop((address, name), None)


class CollectiveReader(ShmReader):
    """Receives weight buckets over its channels, reads the rest from shared memory."""

    name = "collective"

    def __init__(self, files: ShmFiles, settings: CollectiveSettings) -> None:
        super().__init__(files)
        self.settings = settings
        self.channels = ChannelReader(settings)

    def stream_buckets(
        self, ref: DataRef, reader: str = "", device: torch.device | None = None
    ) -> BucketStream | None:
        return self.channels.stream_buckets(ref, reader, device)

    def get_buckets(self, ref: DataRef) -> Buckets | None:
        stream = self.stream_buckets(ref)
        return None if stream is None else stream.assemble()

    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]:
        buckets = self.get_buckets(ref)
        return super().get_tensors(ref) if buckets is None else buckets.tensors()

    def tensors_file(self, ref: DataRef) -> Path | None:
        return None if ref.address else super().tensors_file(ref)

    def close(self) -> None:
        self.channels.close()


def _receive_into(
    channel: ReaderChannel, target: torch.Tensor, what: str, settings: CollectiveSettings
) -> None:
    """Broadcast into ``target``, through a buffer where the group's wire is elsewhere."""
    wire_is_gpu = channel.backend == "nccl"
    if (target.device.type == "cuda") == wire_is_gpu and target.is_contiguous():
        _broadcast(channel.group, target, settings.timeout, what)
        return
    import torch

    landing = torch.empty(target.numel(), dtype=torch.uint8, device="cuda" if wire_is_gpu else "cpu")
    _broadcast(channel.group, landing, settings.timeout, what)
    target.copy_(landing)


class CollectiveTransport(FilesTransport):
    name = "collective"

    def __init__(
        self, run_id: str, root: Path | None = None, settings: CollectiveSettings | None = None
    ) -> None:
        self.files = ShmFiles(run_id, root)
        settings = settings or CollectiveSettings()
        super().__init__(
            run_id, CollectiveStager(self.files, settings), CollectiveReader(self.files, settings)
        )

    @classmethod
    def open(
        cls, run_id: str, run_dir: Path | None = None, config: Config | None = None
    ) -> CollectiveTransport:
        return cls(run_id, settings=CollectiveSettings.of(config))
