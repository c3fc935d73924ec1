"""The buffer behind ``buffer.backend``: in this process's memory, or in Redis (shared by restarts)."""

from __future__ import annotations

from sample_buffer.buffer import SampleBuffer
from sample_buffer.config import BufferConfig


def make_buffer(config: BufferConfig) -> SampleBuffer:
    if config.backend == "memory":
        from sample_buffer.memory import MemoryBuffer

        return MemoryBuffer(config)
    from sample_buffer.redis_buffer import RedisBuffer  # imports the redis client only when asked

    return RedisBuffer(config)
