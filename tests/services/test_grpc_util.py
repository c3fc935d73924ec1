"""Shared gRPC plumbing under a burst: every service's server must take more calls at once than
gRPC core's default of 1,000 waiting to be picked up (beyond it, core cancels them)."""

import asyncio
from collections import Counter

import grpc

from services.grpc_util import channel as grpc_channel
from services.grpc_util import start_server, unary_service
from services.pb.rollmesh.v1.controller_pb2 import ReleaseResponse as Empty


def test_a_burst_of_2500_calls_on_one_channel_all_succeed():
    async def echo(req, ctx):
        await asyncio.sleep(0.5)  # held like a generation, so the burst piles up in the server
        return req

    async def main() -> Counter:
        server = await start_server(unary_service("t.Echo", {"Echo": (Empty, echo)}), "t.Echo", "127.0.0.1", 0)
        channel = grpc_channel(f"127.0.0.1:{server.bound_port}")
        call = channel.unary_unary(
            "/t.Echo/Echo", request_serializer=lambda m: m.SerializeToString(), response_deserializer=Empty.FromString
        )
        codes: Counter = Counter()

        async def one():
            try:
                await call(Empty(), timeout=60)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1

        try:
            await asyncio.gather(*(one() for _ in range(2500)))
        finally:
            await channel.close()
            await server.stop(0)
        return codes

    assert asyncio.run(main()) == Counter({"OK": 2500})
