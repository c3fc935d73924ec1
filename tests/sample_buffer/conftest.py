"""Both backends' buffers for the behavioural suites (the Redis one on a real redis-server)."""

from tests.sample_buffer.helpers import buffer_factory  # noqa: F401  (a fixture)
