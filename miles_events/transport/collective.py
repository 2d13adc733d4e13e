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

Rendezvous. ``publish_buckets`` keeps a publication's buckets in the publishing process and
hosts a ``TCPStore`` there (its address is the reference's ``address``). A reader joins by
adding itself to the store (``join/<n>``: its name, device and GPU), the publisher answers
with the group's backend (NCCL between two GPUs, gloo otherwise, and between two ranks on
one GPU, which NCCL cannot join), and both build the group on the store under the
channel's prefix.

A load is asked for by the reader: it writes the key under ``channel/<n>/ask/<i>``, and the
channel's thread in the publishing process writes a header beside it (the buckets' layouts,
the chunks, or why the key cannot be sent: it was freed) and broadcasts every chunk: bucket
``b``'s bytes ``[start, end)``, at most ``bucket_bytes`` each. The reader places each chunk
as it lands (``BucketStream.receive``): an engine whose weights share the layouts receives
them straight into its own buffers, so no more than a chunk is in flight beside what it
serves.

Every broadcast and every wait on the store has ``publisher.broadcast_timeout``: a peer
that died or hangs turns into a ``CollectiveError`` naming the channel, key and chunk on
the reader (its engine's load fails, and with it the Generator's handler: ``ActorFailed``)
and drops the channel on both sides (its group shut down, an NCCL one aborted); the next
load forms a new one.

Everything else (rollout batches, the Saver's train state, weights put rather than
published) goes through shared memory (``miles_events.transport.shm``), as the
``cuda_ipc`` transport does: those never leave the host.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from miles_events.device.buckets import byte_view
from miles_events.transport.base import BucketStream, FilesTransport
from miles_events.transport.shm import ShmFiles, ShmReader, ShmStager
from miles_events.util.error_text import first_line
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
    gpu: str = ""
    """The UUID of the reader's GPU: NCCL cannot join two ranks on one GPU (a colocated
    engine), which then go over gloo."""


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


def gpu_uuid(device: torch.device) -> str:
    """The UUID of ``device`` (a CUDA device), the same in every process that sees it."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def unblock_joins(store: Any, number: int) -> None:
    """After join ``number`` went unanswered: give up the number the publishing end waits
    for, where it is an earlier one whose reader never said who it is (died between taking
    its number and writing its hello), so that the joins after it go on."""
    try:
        if number and store.check(["next_join"]):
            waiting = int(store.get("next_join"))
            if waiting < number:
                store.compare_set(f"join/{waiting}", "", b"")
    except (RuntimeError, ValueError) as error:  # the publishing end is gone: nothing holds up
        logger.debug("collective: unblocking joins: %s", error)


def join(store: Any, address: str, hello: Hello, answer: str) -> tuple[int, bytes]:
    """Join the publishing end at ``address`` as ``hello`` says: the channel's number and
    the publishing end's ``answer`` for it (``backend`` or ``rendezvous``)."""
    number = 0
    try:
        number = store.add("channels", 1)
        store.set(f"join/{number}", msgspec.msgpack.encode(hello))
        store.wait([f"channel/{number}/{answer}"])
        return number, bytes(store.get(f"channel/{number}/{answer}"))
    except RuntimeError as error:
        unblock_joins(store, number)
        raise CollectiveError(f"channel {hello.name} to {address} not formed: {first_line(error)}") from None


def ask_for(store: Any, prefix: str, index: int, ask: Ask, what: str) -> Header:
    """Write ask ``index`` of the channel at ``prefix`` and read the header the publishing
    end writes beside it (the store's timeout)."""
    key = f"{prefix}/header/{index}"
    try:
        store.set(f"{prefix}/ask/{index}", msgspec.msgpack.encode(ask))
    except RuntimeError as error:
        raise CollectiveError(f"{what}: ask: {first_line(error)}") from None
    try:
        store.wait([key])
        header = msgspec.msgpack.decode(store.get(key), type=Header)
        store.delete_key(key)
    except (RuntimeError, msgspec.DecodeError) as error:
        raise CollectiveError(f"{what}: header: {first_line(error)}") from None
    return header


def connect(address: str, timeout: float) -> Any:
    """A connection of its own to the rendezvous store at ``address`` (``host:port``)."""
    host, _, port = address.rpartition(":")
    try:
        return _dist().TCPStore(host, int(port), is_master=False, timeout=_timedelta(timeout))
    except (RuntimeError, ValueError) as error:
        raise CollectiveError(f"cannot reach the publishing rank at {address}: {first_line(error)}") from None


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
        # Past our own wait's timeout, which aborts the group first: NCCL's watchdog would
        # end the whole process.
        options._timeout = _timedelta(2 * timeout + 30)
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
        raise CollectiveError(f"{what}: {first_line(error)}") from None


def _broadcast_options() -> Any:
    dist = _dist()

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


def release_group(group: Any, backend: str, registered: bool = False) -> None:
    """Give a channel's group up: NCCL's aborted (a broadcast may be stuck in it), gloo's shut
    down; one registered with torch's own (``sglang_group``) destroyed there too."""
    try:
        if registered:
            _dist().destroy_process_group(group)
        elif backend == "nccl":
            group.abort()
        else:
            group.shutdown()
    except (RuntimeError, ValueError) as error:  # already broken: nothing left to give up
        logger.debug("collective: releasing a group: %s", error)


NCCL_SENDS = threading.Lock()
"""One NCCL broadcast at a time in the publishing process: kernels of several communicators
queued at once on one GPU may deadlock."""


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


def _not_staged(key: str) -> Header:
    return Header(key, error=f"{key} is not staged here (freed, or staged by an earlier trainer)")


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
        """Where the published buckets are: NCCL only between a GPU here and another GPU."""
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
        return _dist().TCPStore("127.0.0.1", self.store.port, is_master=False, timeout=IDLE)

    def _wait(self, client: Any, key: str, stopped: Callable[[], bool]) -> bytes | None:
        """The value of ``key`` once written (and deleted); None once ``stopped``."""
        while not stopped():
            try:
                client.wait([key])
            except RuntimeError as error:
                if "timeout" not in str(error).lower():
                    time.sleep(1.0)  # the store is going away: look again, not in a spin
                continue
            if stopped():
                return None
            value = bytes(client.get(key))
            client.delete_key(key)
            return value
        return None

    def _watch(self) -> None:
        """Start a channel for every reader that joins, in the order of their numbers; stop
        the one each replaces. ``next_join`` says which number it waits for: a reader whose
        join goes unanswered gives that number up (``unblock_joins``), in case its reader
        died between taking it and saying who it is."""
        client = self._client()
        while not self._closed:
            number = self._next_join
            client.set("next_join", str(number))
            value = self._wait(client, f"join/{number}", lambda: self._closed)
            if value is None:
                break
            self._next_join += 1
            if not value:
                logger.warning("collective: the reader of channel %d never said who it is", number)
                continue
            try:
                self._start(number, msgspec.msgpack.decode(value, type=Hello))
            except Exception as error:  # one bad join must not end every later one
                logger.warning("collective: channel %d not started: %s", number, first_line(error))

    def _start(self, number: int, hello: Hello) -> None:
        dist = _dist()

        here = gpu_uuid(self.device) if self.device is not None and self.device.type == "cuda" else ""
        nccl = hello.device == "cuda" and here not in ("", hello.gpu) and dist.is_nccl_available()
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
        client = self._client()
        group = None
        try:
            if channel.backend == "nccl" and self.device is not None:
                import torch

                torch.cuda.set_device(self.device)  # a thread's own: NCCL works on its current GPU
            group = self._form(channel, client)
            while True:
                with channel.lock:
                    ask_key = f"{channel.prefix}/ask/{channel.asks}"
                value = self._wait(client, ask_key, lambda: channel.stopped or self._closed)
                if value is None:
                    break
                with channel.lock:
                    channel.asks += 1
                ask = msgspec.msgpack.decode(value, type=Ask)
                self._send(group, channel, ask, client)
        except Exception as error:  # the channel goes; its reader's load says why
            logger.warning(
                "collective: channel %s (%s) dropped: %s", channel.number, channel.hello.name, error
            )
        finally:
            if group is not None:
                release_group(group, channel.backend, registered=channel.hello.protocol == "tensors")
            channel.rendezvous = None
            with self._lock:
                if self.channels.get(channel.hello.name) is channel:
                    del self.channels[channel.hello.name]

    def _form(self, channel: Channel, client: Any) -> Any:
        timeout = self.settings.timeout
        if channel.hello.protocol == "tensors":
            world = 1 + channel.hello.ranks
            return sglang_group(channel.rendezvous, 0, world, channel.group_name, channel.backend, timeout)
        return new_group(_dist().PrefixStore(f"{channel.prefix}/group", client), 0, channel.backend, timeout)

    def _send(self, group: Any, channel: Channel, ask: Ask, client: Any) -> None:
        """The header beside the ask, then the buckets' bytes: in chunks of at most
        ``bucket_bytes`` (``chunks``), or every tensor but ``ask.skip`` in a broadcast of its
        own in the header's order (``tensors``: SGLang's receive)."""
        import torch

        buckets = self.held(ask.key)
        what = f"channel {channel.hello.name}: {ask.key}"
        if buckets is None:
            header = _not_staged(ask.key)
        elif channel.hello.protocol == "tensors":
            header = Header(ask.key, buckets.layouts)
        else:
            header = Header(
                ask.key, buckets.layouts, plan_chunks(buckets.layouts, self.settings.bucket_bytes)
            )
        client.set(f"{channel.prefix}/header/{channel.asks - 1}", msgspec.msgpack.encode(header))
        if buckets is None:
            return
        if channel.hello.protocol == "tensors":
            sent = [
                (f"tensor {slot.name}", buffer[slot.offset : slot.offset + slot.numel])
                for layout, buffer in zip(buckets.layouts, buckets.buffers, strict=True)
                for slot in layout.slots
                if slot.name not in ask.skip
            ]
        else:
            sent = [
                (
                    f"chunk {number + 1}/{len(header.chunks)}",
                    byte_view(buckets.buffers[c.bucket])[c.start : c.end],
                )
                for number, c in enumerate(header.chunks)
            ]
        nccl = channel.backend == "nccl"
        for label, piece in sent:
            if piece.device.type == "cuda" and not nccl:
                piece = piece.cpu()
            elif nccl and piece.device.type != "cuda":
                piece = piece.to(torch.device("cuda", torch.cuda.current_device()))
            with NCCL_SENDS if nccl else contextlib.nullcontext():
                _broadcast(group, piece, self.settings.timeout, f"{what}: {label}")

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
    """Keeps published buckets and serves them over the channels; the rest goes to shm."""

    def __init__(self, files: ShmFiles, settings: CollectiveSettings) -> None:
        super().__init__(files, name="collective")
        self.settings = settings
        self._held: dict[str, Buckets] = {}
        self._lock = threading.Lock()
        self._server: ChannelServer | None = None

    def _held_buckets(self, key: str) -> Buckets | None:
        with self._lock:
            return self._held.get(key)

    def publish_buckets(self, key: str, buckets: Buckets, owner: str) -> DataRef:
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
        with self._lock:
            channel = self._channels.get((address, name))
            if channel is not None:
                return channel
            if device.type == "cuda":
                import torch

                torch.cuda.set_device(device)  # NCCL forms the group on the current GPU
            store = connect(address, self.settings.timeout)  # the channel's own connection
            gpu = gpu_uuid(device) if device.type == "cuda" else ""
            number, answer = join(store, address, Hello(name, device.type, gpu=gpu), "backend")
            backend = answer.decode()
            try:
                group = new_group(
                    _dist().PrefixStore(f"channel/{number}/group", store), 1, backend, self.settings.timeout
                )
            except RuntimeError as error:
                raise CollectiveError(
                    f"channel {name} to {address} not formed: {first_line(error)}"
                ) from None
            channel = ReaderChannel(store, number, group, backend)
            self._channels[(address, name)] = channel
            return channel

    def _drop(self, address: str, name: str, channel: ReaderChannel) -> None:
        """Give the channel up (its publishing end drops it too, at its next failed
        broadcast or when this name joins again): the next load forms a new one."""
        with self._lock:
            if self._channels.get((address, name)) is channel:
                del self._channels[(address, name)]
        release_group(channel.group, channel.backend)

    def stream_buckets(
        self, ref: DataRef, reader: str = "", device: torch.device | None = None
    ) -> BucketStream | None:
        """The buckets behind ``ref`` as they land, over the channel of ``reader`` (an
        engine's name; default: this process); None for data that is not published buckets."""
        import torch

        if not ref.address:
            return None
        device = device or torch.device("cpu")
        name = reader or f"pid-{os.getpid()}"
        channel = self._channel(ref.address, name, device)
        what = f"channel {name}: {ref.key}"
        if not channel.lock.acquire(timeout=self.settings.timeout):
            self._drop(ref.address, name, channel)
            raise CollectiveError(f"{what}: the channel's previous load never finished")
        channel.asks += 1
        try:
            header = ask_for(channel.store, f"channel/{channel.number}", channel.asks - 1, Ask(ref.key), what)
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
            except BaseException:
                self._drop(ref.address, name, channel)  # the publisher may be mid-stream
                raise
            finally:
                channel.lock.release()

        def abandon() -> None:  # never received: the publisher is left mid-stream
            self._drop(ref.address, name, channel)
            channel.lock.release()

        return BucketStream(header.key, header.layouts, chunks, abandon)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            taken = channel.lock.acquire(timeout=1.0)  # after a load in progress
            release_group(channel.group, channel.backend)
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
        number, answer = join(store, address, Hello(name, device, "tensors", ranks), "rendezvous")
        try:
            rendezvous = msgspec.msgpack.decode(answer, type=Rendezvous)
        except msgspec.DecodeError as error:
            raise CollectiveError(f"channel {name} to {address} not formed: {first_line(error)}") from None
        self._channels[(address, name)] = DrivenChannel(store, number, rendezvous)
        return rendezvous, True

    def ask(self, address: str, name: str, key: str, skip: tuple[str, ...] = ()) -> Header:
        """Ask for ``key`` on ``name``'s channel: the header, once the publishing rank is about
        to broadcast its tensors (all but ``skip``, in the header's order)."""
        channel = self._channels[(address, name)]
        what = f"channel {name}: {key}"
        channel.asks += 1
        try:
            header = ask_for(
                channel.store, f"channel/{channel.number}", channel.asks - 1, Ask(key, skip), what
            )
        except CollectiveError:
            self.drop(address, name)
            raise
        if header.error:
            raise CollectiveError(f"{what}: {header.error}")
        return header

    def drop(self, address: str, name: str) -> None:
        """Forget ``name``'s channel: the next load joins anew (its receivers form a new group)."""
        self._channels.pop((address, name), None)


class CollectiveReader(ShmReader):
    """Receives published buckets over its channels, reads the rest from shared memory."""

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
