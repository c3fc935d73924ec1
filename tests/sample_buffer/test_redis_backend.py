"""What only the Redis backend has to prove: durability across kill -9, and bad keys/entries."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis

from sample_buffer.buffer import BufferBackendError
from sample_buffer.config import BufferConfig
from sample_buffer.redis_buffer import RedisBuffer
from services.processes import RedisServer
from tests.sample_buffer.helpers import make_group


def config(url: str, **kw) -> BufferConfig:
    return BufferConfig(backend="redis", redis_url=url, key_prefix=f"t:{uuid.uuid4().hex[:8]}", **kw)


def test_acknowledged_puts_survive_kill_9_with_aof(tmp_path):
    server = RedisServer(tmp_path).start()
    cfg = config(server.url)
    try:

        async def put_all():
            buf = RedisBuffer(cfg)
            for i in range(50):
                assert (await buf.put(make_group(f"d{i}", version=1))).accepted
            await buf.close()

        asyncio.run(put_all())
        server.kill9()  # no shutdown, no final fsync: only what AOF already holds survives
        server.start()  # same port, same directory

        async def get_all():
            buf = RedisBuffer(cfg)
            batch = await buf.get(100, version=1, max_staleness=0, timeout_s=1)
            n = await buf.ack(batch.batch_id)
            stats = await buf.stats()
            await buf.close()
            return batch, n, stats

        batch, n, stats = asyncio.run(get_all())
        assert sorted(g.group_id for g in batch.decode()) == sorted(f"d{i}" for i in range(50))
        assert n == 50 and stats["put"] == 50 and stats["consumed"] == 50
    finally:
        server.stop()


def test_wrong_type_key_is_a_clear_error(redis_server):
    cfg = config(redis_server.url)
    redis.Redis.from_url(redis_server.url).set(f"{cfg.key_prefix}:groups", b"not a stream")

    async def go():
        buf = RedisBuffer(cfg)
        try:
            with pytest.raises(BufferBackendError, match="exists with another type"):
                await buf.put(make_group("x"))
            with pytest.raises(BufferBackendError, match="exists with another type"):
                await buf.stats()
        finally:
            await buf.close()

    asyncio.run(go())


def test_corrupt_entry_in_the_stream_is_dropped_counted_and_skipped(redis_server):
    cfg = config(redis_server.url)

    async def go():
        buf = RedisBuffer(cfg)
        await buf.put(make_group("good1"))
        await buf.redis.xadd(buf.stream, {"d": b"\x01\x00\xff\xff\xff\xffjunk", "v": 0})
        await buf.redis.xadd(buf.stream, {"x": b"no fields we know"})
        await buf.put(make_group("good2"))
        batch = await buf.get(4, 0, 0, timeout_s=0.5)
        stats = await buf.stats()
        await buf.close()
        return batch, stats

    batch, stats = asyncio.run(go())
    assert [g.group_id for g in batch.decode()] == ["good1", "good2"]
    assert stats["dropped_corrupt"] == 2 and stats["depth"] == 0


def test_runs_with_different_prefixes_do_not_see_each_other(redis_server):
    async def go():
        a, b = RedisBuffer(config(redis_server.url)), RedisBuffer(config(redis_server.url))
        await a.put(make_group("only-a"))
        got_b = await b.get(1, 0, 0, timeout_s=0.2)
        got_a = await a.get(1, 0, 0, timeout_s=0.2)
        await a.close()
        await b.close()
        return got_a, got_b

    got_a, got_b = asyncio.run(go())
    assert got_b.groups == [] and [g.group_id for g in got_a.decode()] == ["only-a"]


def test_a_get_with_under_a_millisecond_left_does_not_block_forever(redis_server):
    """XREADGROUP BLOCK 0 waits forever: a wait shorter than 1 ms must still be a bounded read."""
    cfg = config(redis_server.url, redis_timeout_s=3)

    async def go():
        buf = RedisBuffer(cfg)
        try:
            t0 = asyncio.get_running_loop().time()
            batch = await buf.get(1, 0, 0, timeout_s=0.0005)
            return batch, asyncio.get_running_loop().time() - t0
        finally:
            await buf.close()

    batch, took = asyncio.run(go())
    assert batch.batch_id == "" and batch.groups == [] and took < 1.0


async def put_and_get(cfg: BufferConfig) -> int:
    """Put one group into a Redis buffer and get it back: how many came."""
    buf = RedisBuffer(cfg)
    try:
        assert (await buf.put(make_group("g", version=1))).accepted
        return len((await buf.get(1, version=1, max_staleness=0, timeout_s=1)).groups)
    finally:
        await buf.close()


def test_a_redis_with_a_password_takes_the_buffer_only_with_it(tmp_path, monkeypatch):
    """The deployments' Redis asks for a password (compose and Helm); the buffer reads it from the
    environment, never from its URL or a command line, and says where to put it when it lacks it."""
    server = RedisServer(tmp_path, password="s3cret-redis").start()
    cfg = config(server.url)

    try:
        assert "s3cret-redis" not in Path(f"/proc/{server.proc.pid}/cmdline").read_text()
        monkeypatch.delenv("ROLLMESH_REDIS_PASSWORD", raising=False)
        with pytest.raises(BufferBackendError, match=r"refused the buffer .*\$ROLLMESH_REDIS_PASSWORD"):
            asyncio.run(put_and_get(cfg))
        monkeypatch.setenv("ROLLMESH_REDIS_PASSWORD", "s3cret-redis")
        assert asyncio.run(put_and_get(cfg)) == 1
    finally:
        server.stop()


@pytest.mark.parametrize(
    "url, error",
    [("redis://:pw@127.0.0.1:6379/0", "carries a password"), ("http://127.0.0.1:6379", "scheme 'http'")],
)
def test_a_redis_url_with_a_password_or_another_scheme_is_refused(url, error):
    with pytest.raises(ValueError, match=error):
        BufferConfig(backend="redis", redis_url=url)
    assert BufferConfig(redis_url="rediss://127.0.0.1:6380/0").redis_url.startswith("rediss://")


def test_the_buffer_speaks_tls_to_redis_and_checks_its_certificate(tmp_path, monkeypatch):
    """rediss://: Redis serving TLS only, the buffer trusting the CA that signed it (and checking the
    host name). Without that CA the buffer refuses the connection; plain redis:// gets nothing."""
    import trustme

    from services.auth import TlsConfig

    ca, other = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    other.cert_pem.write_to_path(str(tmp_path / "other.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    tls = TlsConfig(
        cert_path=str(tmp_path / "cert.pem"), key_path=str(tmp_path / "key.pem"), ca_path=str(tmp_path / "ca.pem")
    )
    monkeypatch.setenv("ROLLMESH_REDIS_PASSWORD", "s3cret-tls")
    server = RedisServer(tmp_path / "data", password="s3cret-tls", tls=tls)
    (tmp_path / "data").mkdir()
    server.start()

    try:
        assert server.url.startswith("rediss://")
        assert asyncio.run(put_and_get(config(server.url).model_copy(update={"redis_ca_path": tls.ca_path}))) == 1
        untrusted = config(server.url).model_copy(update={"redis_ca_path": str(tmp_path / "other.pem")})
        with pytest.raises(BufferBackendError, match="certificate verify failed"):
            asyncio.run(put_and_get(untrusted))
        with pytest.raises(BufferBackendError):  # plaintext to a TLS port: no answer it could read
            asyncio.run(put_and_get(config(server.url.replace("rediss://", "redis://"))))
    finally:
        server.stop()
