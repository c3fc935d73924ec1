import asyncio
import uuid

import numpy as np
import pytest

from sample_buffer.backends import make_buffer
from sample_buffer.config import BufferConfig
from sample_buffer.trajectory import Group, Trajectory


def make_group(
    gid: str, version: int = 0, rewards=(0.0, 1.0), prompt_len: int = 4, gen_len: int = 6, domain: str = ""
) -> Group:
    rng = np.random.default_rng(abs(hash(gid)) % 2**32)
    trajs = []
    for i, r in enumerate(rewards):
        trajs.append(
            Trajectory(
                trajectory_id=f"{gid}/{i}",
                group_id=gid,
                prompt_id=f"p-{gid}",
                token_ids=rng.integers(0, 250, prompt_len + gen_len),
                loss_mask=[0] * prompt_len + [1] * gen_len,
                behavior_logprobs=-rng.random(gen_len),
                token_versions=[version] * gen_len,
                reward=r,
                start_version=version,
                finish_reason="stop",
                metadata={"env": "test", "turns": [prompt_len]},
            )
        )
    return Group(gid, f"p-{gid}", trajs, domain)


_made: list = []  # buffers of the running test, closed inside its event loop by run()


@pytest.fixture(params=["memory", "redis"])
def buffer_factory(request):
    made = _made

    def make(**kw):
        cfg = {"backend": request.param}
        if request.param == "redis":
            server = request.getfixturevalue("redis_server")
            cfg |= {"redis_url": server.url, "key_prefix": f"test:{uuid.uuid4().hex[:8]}"}
        buf = make_buffer(BufferConfig(**(cfg | kw)))
        made.append(buf)
        return buf

    yield make
    made.clear()


def run(coro):
    async def main():
        try:
            return await coro
        finally:
            for b in _made:
                await b.close()

    return asyncio.run(main())
