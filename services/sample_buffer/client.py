"""Async gRPC client of the SampleBuffer: the training loop's ``SampleSource`` (get, ack, requeue) and,
through ``PutBatcher``, the rollout loop's ``SampleSink``. gRPC errors become the project's own."""

from __future__ import annotations

import asyncio

import grpc

from sample_buffer.buffer import Batch, PutResult
from sample_buffer.codec import encode_group
from sample_buffer.config import BufferConfig
from sample_buffer.trajectory import Group
from services.auth import AuthConfig
from services.convert import project_error
from services.grpc_util import channel
from services.pb.rollmesh.v1 import sample_buffer_pb2 as pb
from services.pb.rollmesh.v1 import sample_buffer_pb2_grpc
from services.wire_limits import PUT_BATCH_BYTES, SAMPLE_BUFFER_MAX_MESSAGE_BYTES, SAMPLE_BUFFER_MAX_PUT_BYTES


class BufferClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = 60.0,
        auth: AuthConfig | None = None,
        put_timeout_s: float = BufferConfig.model_fields["put_timeout_s"].default,
    ) -> None:
        """``timeout_s``: of a call, beyond what the call itself may wait; ``put_timeout_s``: how long a put
        may wait on a full buffer (the run config's ``buffer.put_timeout_s``, its one owner)."""
        self.address, self.timeout_s, self.put_timeout_s = address, timeout_s, put_timeout_s
        self._channel = channel(
            address,
            options=[
                ("grpc.max_receive_message_length", SAMPLE_BUFFER_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", SAMPLE_BUFFER_MAX_PUT_BYTES),
            ],
            auth=auth,
        )
        self.stub = sample_buffer_pb2_grpc.SampleBufferStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def put(self, group: Group | bytes, timeout_s: float | None = None) -> PutResult:
        return (await self.put_many([group], timeout_s))[0]

    async def _call(self, method, request, timeout_s: float):
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise project_error(e) from None

    async def put_many(self, groups: list[Group | bytes], timeout_s: float | None = None) -> list[PutResult]:
        timeout_s = self.put_timeout_s if timeout_s is None else timeout_s
        datas = [encode_group(g) if isinstance(g, Group) else g for g in groups]
        res = await self._call(
            self.stub.Put, pb.PutRequest(groups=datas, timeout_s=timeout_s), timeout_s + self.timeout_s
        )
        return [PutResult(r.accepted, r.reason) for r in res.results]

    async def get(self, num_groups: int, version: int, max_staleness: int, timeout_s: float) -> Batch:
        req = pb.GetRequest(num_groups=num_groups, version=version, max_staleness=max_staleness, timeout_s=timeout_s)
        res = await self._call(self.stub.Get, req, timeout_s + self.timeout_s)
        return Batch(res.batch_id, list(res.groups), res.num_dropped_stale)

    async def ack(self, batch_id: str) -> int:
        return (await self._call(self.stub.Ack, pb.AckRequest(batch_id=batch_id), self.timeout_s)).num_acked

    async def requeue(self) -> int:
        return (await self._call(self.stub.Requeue, pb.RequeueRequest(), self.timeout_s)).num_requeued

    async def stats(self) -> pb.BufferStats:
        return await self.stub.Stats(pb.BufferStatsRequest(), timeout=self.timeout_s)


class PutBatcher:
    """Micro-batches puts: groups that finish within ``max_delay_s`` of each other share one RPC.

    ``await batcher.put(group)`` returns that group's result once its batch is stored, so the
    caller keeps per-group back-pressure and errors while the wire sees few, larger calls.
    """

    def __init__(self, client: BufferClient, max_groups: int = 32, max_delay_s: float = 0.005) -> None:
        self.client, self.max_groups, self.max_delay_s = client, max_groups, max_delay_s
        self._pending: list[tuple[bytes, asyncio.Future]] = []
        self._bytes = 0  # encoded bytes pending
        self._flusher: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()  # held: the event loop keeps only weak references

    async def put(self, group: Group | bytes, timeout_s: float | None = None) -> PutResult:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((encode_group(group) if isinstance(group, Group) else group, fut))
        self._bytes += len(self._pending[-1][0])
        # Sent at max_groups, or before the batch could pass the buffer's receive limit.
        if len(self._pending) >= self.max_groups or self._bytes >= PUT_BATCH_BYTES:
            self._flush(timeout_s)
        elif self._flusher is None:
            self._flusher = asyncio.get_running_loop().call_later(self.max_delay_s, self._flush, timeout_s)
        return await fut

    def _flush(self, timeout_s: float | None) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        # A caller cancelled while waiting (its worker stopped) has given its slot back: its group must
        # not be stored behind its back.
        batch, self._pending, self._bytes = [(d, f) for d, f in self._pending if not f.cancelled()], [], 0
        if batch:
            task = asyncio.ensure_future(self._send(batch, timeout_s))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[bytes, asyncio.Future]], timeout_s: float | None) -> None:
        try:
            results = await self.client.put_many([d for d, _ in batch], timeout_s)
        except Exception as e:  # every waiting caller gets the error of its batch
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), res in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(res)
