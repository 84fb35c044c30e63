"""Trainer-to-vLLM weight pushes on the CPU through vLLM's own weight-transfer API, over a gloo process group.

vLLM's own transfer engines are for GPUs (NCCL, CUDA IPC). This module adds one named ``"gloo"`` through vLLM's
extension points:

* the worker side, :class:`GlooWeightTransferEngine`, is registered in ``WeightTransferEngineFactory`` by the
  ``vllm.general_plugins`` entry point :func:`register_vllm_plugin`, which vLLM runs in each of its processes;
* the trainer side, :class:`GlooTrainerWeightTransferEngine`, is registered in ``WeightTransferTrainerFactory`` by
  :func:`register_trainer_engine`.

Serve with ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}'``, then on the
trainer::

    register_trainer_engine()
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=1 + server_world_size, rank=0),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model),
    )
    engine.send_weights(weight_version="step-1")  # /weight_info and each output's weight_versions report it

The trainer is rank 0 of a group of its own (it never touches the default ``torch.distributed`` world of either
side); worker *i* is rank ``rank_offset + i``. A push runs inside vLLM's layerwise reload (``start_weight_update`` /
``finish_weight_update``), so fused layers (qkv, gate_up) load correctly whatever order and chunking the tensors
arrive in. Pause generation around a push (``POST /pause?mode=keep``, then ``/resume``): mid-push, layers are being
swapped. Neither the pause nor the push drops the server's cached keys and values or image features: reset them
after the push (``POST /reset_prefix_cache?reset_running_requests=true`` and ``/reset_encoder_cache``), so that kept
requests and later prompts recompute theirs with the new weights.

Packed pushes treat the parameters, in metadata order, as one byte stream cut into buffers of exactly
``packed_buffer_size_bytes`` (the last one shorter): one gloo broadcast per buffer, so memory stays bounded on both
sides whatever the size of the largest tensor. Both sides derive the cuts from the same metadata and buffer size,
which is why the trainer sends its buffer size to the workers at init.

A failed push leaves the group closed on both sides: initialise again (``trainer_init``) before the next one.
If the server refuses or fails the init, ``trainer_init`` raises its error at once and gives the port back (workers
that fail after joining the store are the exception: then gloo's own rendezvous fails at ``timeout_s``).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import ProcessGroupGloo

BACKEND = "gloo"
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 256 * 1024 * 1024
# Every rendezvous and broadcast of the group fails after this long instead of hanging on a peer that went away.
DEFAULT_TIMEOUT_S = 300.0
# How long a trainer whose broadcast failed waits for the server's reply, whose error is the more telling.
SERVER_ERROR_WAIT_S = 10.0

__all__ = [
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "GlooWeightTransferInitInfo",
    "GlooWeightTransferUpdateInfo",
    "register_trainer_engine",
    "register_vllm_plugin",
]


# ------------------------------------------------------------------------------------------------ wire format
@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the trainer's group; built and sent by the trainer at init."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.packed_buffer_size_bytes <= 0:
            raise ValueError(f"packed_buffer_size_bytes must be positive, got {self.packed_buffer_size_bytes}.")


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One push's parameters, in the order the trainer sends them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per parameter: got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}."
            )

    @classmethod
    def from_metadata(cls, meta: list[ParamMeta]) -> GlooWeightTransferUpdateInfo:
        return cls(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype {name!r} in the weight update.")
    return dtype


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: gloo broadcasts bytes, whatever the dtype (bfloat16 included)."""
    return tensor.reshape(-1).view(torch.uint8)


def _broadcast(group: ProcessGroupGloo, tensor: torch.Tensor) -> None:
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0  # the trainer, as a rank of this group
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()  # raises once the group's timeout passes without the peers


# Each worker rank sets this key in the store once it has connected, before entering gloo's rendezvous. The trainer
# enters the rendezvous only when every worker has, so a server that fails or refuses before joining leaves the
# trainer's end waiting in a loop it can leave, not inside gloo, which would hold its thread until the timeout.
JOINED_KEY = "targetpo-gloo-weight-transfer/joined"
PEER_POLL_S = 0.05


def _gloo_group(store: Any, local_address: str, rank: int, world_size: int, timeout_s: float) -> ProcessGroupGloo:
    """Gloo's rendezvous on ``store``, each rank's connections listening on ``local_address``.

    Built directly rather than with ``torch.distributed.init_process_group``, so neither side's default world (vLLM's
    workers have one) is touched; and rather than with vLLM's stateless helper, which redirects the process's stdout
    while it connects, so two groups opened at once in one process (tests) could leave stdout pointing nowhere.
    """
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [ProcessGroupGloo.create_device(hostname=local_address)]
    return ProcessGroupGloo(PrefixStore("targetpo-gloo-weight-transfer", store), rank, world_size, options)


def _join_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> ProcessGroupGloo:
    """A worker's end: connect to the trainer's store at ``address``, say so, and enter the rendezvous."""
    from torch.distributed import TCPStore

    store = TCPStore(address, port, world_size, False, timedelta(seconds=timeout_s))
    store.set(f"{JOINED_KEY}/{rank}", "1")
    # Its connections listen on the interface the trainer reaches, not on every one: they carry raw weights.
    return _gloo_group(store, address_towards(address, port), rank, world_size, timeout_s)


class _TrainerRendezvous:
    """The trainer's end (rank 0): the store is bound at once; the wait for the workers runs on a daemon thread.

    :meth:`cancel` ends that wait within :data:`PEER_POLL_S` when the other side has failed, so no thread is left
    blocked holding the store and its port until the timeout (a process exiting with a thread inside gloo's
    rendezvous can abort in native teardown).
    """

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        self.address, self.world_size, self.timeout_s = address, world_size, timeout_s
        # Bound here, so a port already in use fails the caller at once.
        self.store: Any = _store_listening_on(address, port, world_size, timedelta(seconds=timeout_s))
        self.group: Future = Future()
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._open, name="gloo-rendezvous", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        store, self.store = self.store, None  # only this thread holds it from now on
        try:
            group = self._rendezvous(store)
        except BaseException as error:  # noqa: BLE001 - handed to the caller through the future
            del store
            # The finished frames below still hold the store; clearing them lets its port go now, so the caller can
            # initialise again on the same port, rather than when the error is collected.
            traceback.clear_frames(error.__traceback__)
            self.group.set_exception(error)
        else:
            self.group.set_result(group)

    def _rendezvous(self, store: Any) -> ProcessGroupGloo:
        self._wait_for_workers(store)
        return _gloo_group(store, self.address, 0, self.world_size, self.timeout_s)

    def _wait_for_workers(self, store: Any) -> None:
        import time

        keys = [f"{JOINED_KEY}/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            if self._cancelled.wait(PEER_POLL_S):
                raise RuntimeError("The gloo rendezvous was cancelled: the server failed to join.")
            if time.monotonic() > deadline:
                joined = sum(store.check([key]) for key in keys)
                raise TimeoutError(
                    f"Only {joined} of the server's {len(keys)} workers joined the gloo weight transfer within "
                    f"{self.timeout_s:g} s: check that the server reaches {self.address}, serves with "
                    f'--weight-transfer-config \'{{"backend": "gloo"}}\' and has the same targetpo version.'
                )

    def cancel(self) -> None:
        """Stop waiting for the workers and give the store back; a group already opened is closed."""
        self._cancelled.set()
        # Within a poll unless every worker had joined and the thread is inside gloo's rendezvous, which then fails
        # at its own timeout.
        self._thread.join(timeout=1.0)
        if self.group.done() and self.group.exception() is None:
            _close_group(self.group.result())


def _store_listening_on(address: str, port: int, world_size: int, timeout: timedelta) -> Any:
    """The group's TCPStore server, on a socket bound to ``address`` only (a TCPStore given only a port listens on
    every interface, and this one hands out the addresses weights travel to); it does not wait for the workers."""
    import socket

    from torch.distributed import TCPStore

    listener = socket.create_server((address, port), family=_family(address))
    listen_fd = listener.detach()
    try:
        return TCPStore(address, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=listen_fd)
    except BaseException:
        socket.close(listen_fd)
        raise


def _family(address: str) -> Any:
    import ipaddress
    import socket

    try:
        return socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    except ValueError:  # a host name: resolved by the socket as IPv4
        return socket.AF_INET


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host``: the interface a peer there reaches this one on."""
    import socket

    with socket.socket(_family(host), socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def _close_group(group: ProcessGroupGloo) -> None:
    group.shutdown()  # closes the connections: a peer still waiting on a broadcast fails at once


# ------------------------------------------------------------------------------------------------ worker side
def _finish_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    """vLLM's ``finalize_layerwise_reload``, then a refresh of tied layers that were loaded only through their twin.

    A tied ``lm_head`` receives no tensor of its own (its weight arrives as ``embed_tokens``'), so the reload only
    puts its parameter back, and that parameter does hold the new values. But on the CPU, processing after loading
    packs a layer's weight for vLLM's GEMM kernels, and the ``lm_head``'s pack would stay the one made from the old
    weights: the engine's logits would still come from them. Running its processing again repacks it.
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    unloaded = []
    for module in model.modules():
        info = get_layerwise_info(module)
        if info.can_load() and info.load_numel == 0 and getattr(module, "quant_method", None) is not None:
            unloaded.append(module)
    finalize_layerwise_reload(model, model_config)
    if not unloaded:
        return
    owners: dict[int, int] = {}  # parameter -> how many modules hold it directly
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    for module in unloaded:
        if any(owners[id(param)] > 1 for param in module.parameters(recurse=False)):
            module.quant_method.process_weights_after_loading(module)


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """vLLM worker side: receives the trainer's broadcasts and loads them through the layerwise reload."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: ProcessGroupGloo | None = None
        self.packed = False
        self.packed_buffer_size_bytes = DEFAULT_PACKED_BUFFER_SIZE_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        if self.group is not None:  # a trainer reconnecting: the old group's peer is gone
            self.shutdown()
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        # Unique across data-parallel replicas: the replica's first worker rank plus this worker's rank in it.
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = _join_group(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker_rank,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        _finish_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only torch; gloo's
        # broadcasts have completed (waited on) by the time receive_weights returns, so there is nothing to wait for.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # The trainer is still broadcasting, and a send waits for its receiver: closing the group fails it at
            # once instead of at the timeout. The trainer then has to init again, as after any failed push.
            self.shutdown()
            raise

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("The gloo weight transfer is not initialised: call init_weight_transfer_engine first.")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        dtypes = [_dtype(name) for name in update_info.dtype_names]
        # Partial loads are the point here (a layer's tensors arrive over several load_weights calls); the reload
        # checks completeness at finish_weight_update.
        with disable_mtp_completeness_check():
            if self.packed:
                self._receive_packed(update_info.names, dtypes, update_info.shapes)
            else:
                self._receive_unpacked(update_info.names, dtypes, update_info.shapes)

    def _receive_unpacked(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> None:
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype)
            if tensor.numel():  # the trainer skips empty tensors too
                _broadcast(self.group, _as_bytes(tensor))
            self.model.load_weights([(name, tensor)])

    def _receive_packed(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> None:
        # Each tensor gets storage of its own, allocated when its turn comes, and the buffer is reused: the layerwise
        # reload keeps the tensors it is given until their whole layer is in, so they cannot be views of the buffer.
        sizes = [_numel(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes)]
        total = sum(sizes)
        buffer = torch.empty(min(self.packed_buffer_size_bytes, total), dtype=torch.uint8)
        chunk, offset, received = buffer[:0], 0, 0
        complete: list[tuple[str, torch.Tensor]] = []
        for name, dtype, shape, size in zip(names, dtypes, shapes, sizes):
            tensor = torch.empty(shape, dtype=dtype)
            data, filled = _as_bytes(tensor), 0
            while filled < size:
                if offset == chunk.numel():
                    if complete:  # what the last buffers completed goes to the model before more arrive
                        self.model.load_weights(complete)
                        complete = []
                    chunk, offset = buffer[: min(buffer.numel(), total - received)], 0
                    _broadcast(self.group, chunk)
                    received += chunk.numel()
                take = min(size - filled, chunk.numel() - offset)
                data[filled : filled + take].copy_(chunk[offset : offset + take])
                filled += take
                offset += take
            complete.append((name, tensor))
        if complete:
            self.model.load_weights(complete)

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            _close_group(group)


# ------------------------------------------------------------------------------------------------ trainer side
@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the handshake. ``world_size`` is 1 (the trainer) plus the server's ``/get_world_size``.

    The packing settings and the timeout go to the workers at init, so both sides cut the stream alike.
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 broadcasts the source's tensors and drives the server's weight-update calls.

    Other trainer ranks only iterate the source, so collective gathers (FSDP ``full_tensor()``) stay in step.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        packed: bool = True,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.group: ProcessGroupGloo | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("The gloo weight transfer pushes a whole model each time: pass a WeightSource.")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
        )
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            timeout_s=init_info.timeout_s,
        )
        # Both sides block in the rendezvous until all ranks are in, so the server's init runs on a thread too; whichever
        # fails first is raised (the server refusing the init would otherwise leave us waiting out the timeout).
        rendezvous = _TrainerRendezvous(
            init_info.master_address, init_info.master_port, init_info.world_size, init_info.timeout_s
        )
        remote = _in_daemon_thread(client.init_weight_transfer_engine, asdict(worker_info))
        try:
            _first_error(remote, rendezvous.group)
        except BaseException:
            rendezvous.cancel()
            raise
        engine.group = rendezvous.group.result()
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        """Push every tensor of the source; ``weight_version`` labels the new weights (``/weight_info``)."""
        assert self.source is not None  # trainer_init requires one
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # join the source's collective gathers, if any
                pass
            return
        if self.group is None:
            raise RuntimeError("The gloo weight transfer is shut down (or was never initialised).")

        self.client.start_weight_update()
        update_info = asdict(GlooWeightTransferUpdateInfo.from_metadata(meta))
        # The server's update_weights returns only once it has received everything, so it runs beside the broadcasts.
        remote = _in_daemon_thread(self.client.update_weights, update_info)
        try:
            pairs = _checked(self.source, meta)
            if self.packed:
                self._send_packed(pairs, sum(_numel(m.shape) * m.dtype.itemsize for m in meta), remote)
            else:
                self._send_unpacked(pairs, remote)
            remote.result()
        except BaseException:
            # Whatever failed, the workers are (or would be) waiting on broadcasts that will not come: closing the
            # group makes them fail at once instead of at the timeout. The group cannot be reused after this.
            self._abandon_group()
            raise
        self.client.finish_weight_update(weight_version)

    def _send_unpacked(self, pairs: Iterator[tuple[str, torch.Tensor]], remote: Future) -> None:
        for _name, tensor in pairs:
            if tensor.numel():
                self._broadcast(_as_bytes(tensor.detach().contiguous()), remote)

    def _send_packed(self, pairs: Iterator[tuple[str, torch.Tensor]], total: int, remote: Future) -> None:
        buffer = torch.empty(min(self.packed_buffer_size_bytes, total), dtype=torch.uint8)
        filled = 0
        for _name, tensor in pairs:
            data = _as_bytes(tensor.detach().contiguous())
            offset = 0
            while offset < data.numel():
                take = min(data.numel() - offset, buffer.numel() - filled)
                buffer[filled : filled + take].copy_(data[offset : offset + take])
                filled += take
                offset += take
                if filled == buffer.numel():
                    self._broadcast(buffer, remote)  # synchronous: the buffer can be refilled right away
                    filled = 0
        if filled:
            self._broadcast(buffer[:filled], remote)

    def _broadcast(self, tensor: torch.Tensor, remote: Future) -> None:
        _raise_if_failed(remote)
        try:
            _broadcast(self.group, tensor)
        except RuntimeError as error:
            # A worker that fails closes its end, which is what failed this broadcast: the server's error says why.
            try:
                remote.result(timeout=SERVER_ERROR_WAIT_S)
            except FutureTimeoutError:
                raise error from None
            except BaseException as server_error:
                raise server_error from error
            raise

    def _abandon_group(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            try:
                _close_group(group)
            except Exception:  # noqa: BLE001, S110 - the error being raised matters more than a failed close
                pass

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            _close_group(group)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _in_daemon_thread(function, *args) -> Future:
    """Run ``function(*args)`` on a daemon thread: a call stuck on a dead peer must not block interpreter exit."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(error)

    threading.Thread(target=run, name=f"gloo-{getattr(function, '__name__', 'call')}", daemon=True).start()
    return future


def _first_error(*futures: Future) -> None:
    """Wait for all of ``futures``, raising the first failure as soon as it happens."""
    wait(futures, return_when=FIRST_EXCEPTION)
    for future in futures:
        if future.done() and future.exception() is not None:
            raise future.exception()


def _raise_if_failed(remote: Future) -> None:
    """Raise the server's error if it has already given up: a broadcast would wait for it in vain."""
    if remote.done() and remote.exception() is not None:
        raise remote.exception()


def _checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors, checked against the metadata the workers were sent.

    The workers cut the stream from the metadata, so a tensor that differs from it would shift every later one.
    """
    count = 0
    for name, tensor in source:
        if count >= len(meta):
            raise ValueError(
                f"The WeightSource yielded more tensors than its metadata() lists ({len(meta)}): {name!r}."
            )
        expected = meta[count]
        if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(
                f"The WeightSource's tensor {count} is {name!r} {tensor.dtype} {tuple(tensor.shape)}, but its "
                f"metadata() lists {expected.name!r} {expected.dtype} {tuple(expected.shape)}."
            )
        count += 1
        yield name, tensor
    if count != len(meta):
        raise ValueError(f"The WeightSource yielded {count} tensors but its metadata() lists {len(meta)}.")


# ------------------------------------------------------------------------------------------------ registration
def register_trainer_engine() -> None:
    """Make ``WeightTransferTrainerFactory.trainer_init`` accept :class:`GlooTrainerInitInfo`; safe to call again."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "GlooTrainerWeightTransferEngine")
    except ValueError:  # already registered: vLLM refuses duplicates
        pass


def register_vllm_plugin() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM's workers can then create the ``"gloo"`` engine.

    vLLM may run plugins several times in a process; registering lazily, by module path, keeps this cheap.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    except ValueError:  # already registered: vLLM refuses duplicates
        pass
