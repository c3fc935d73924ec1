"""Async gRPC client of the SampleBuffer (EnvManagers put, the trainer gets and acks)."""

from __future__ import annotations

import grpc

from sample_buffer.buffer import Batch
from sample_buffer.codec import encode_group
from sample_buffer.trajectory import Group
from services.pb.rollmesh.v1 import sample_buffer_pb2 as pb
from services.pb.rollmesh.v1 import sample_buffer_pb2_grpc
from services.sample_buffer.server import MAX_MESSAGE_BYTES


class BufferClient:
    def __init__(self, address: str, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self.stub = sample_buffer_pb2_grpc.SampleBufferStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def put(self, group: Group | bytes, timeout_s: float = 0.0) -> pb.PutResponse:
        data = encode_group(group) if isinstance(group, Group) else group
        return await self.stub.Put(pb.PutRequest(group=data, timeout_s=timeout_s), timeout=timeout_s + self.timeout_s)

    async def get(self, num_groups: int, current_version: int, max_staleness: int, timeout_s: float) -> Batch:
        req = pb.GetRequest(
            num_groups=num_groups, current_version=current_version, max_staleness=max_staleness, timeout_s=timeout_s
        )
        res = await self.stub.Get(req, timeout=timeout_s + self.timeout_s)
        return Batch(res.batch_id, list(res.groups))

    async def ack(self, batch_id: str) -> int:
        return (await self.stub.Ack(pb.AckRequest(batch_id=batch_id), timeout=self.timeout_s)).num_acked

    async def stats(self) -> pb.BufferStats:
        return await self.stub.Stats(pb.BufferStatsRequest(), timeout=self.timeout_s)
