"""``wait_for`` keeps a cancel that comes as the awaited call ends (Python 3.11's ``asyncio.wait_for``
returned the result instead, and a polling loop it sat in never stopped), and times out as
``asyncio.wait_for`` does."""

from __future__ import annotations

import asyncio

import pytest

from sample_buffer.deadlines import wait_for


def test_a_cancel_that_comes_as_the_awaited_call_ends_stops_a_polling_loop():
    async def main():
        rounds = []

        async def poll(answer: asyncio.Future):
            while True:  # as the controller's buffer poll: wait within a deadline, sleep, again
                rounds.append(await wait_for(asyncio.shield(answer), 10))
                await asyncio.sleep(0.01)

        answer = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(poll(answer))
        await asyncio.sleep(0.01)
        answer.set_result("count")  # the call ends ...
        task.cancel()  # ... in the same turn as the caller is cancelled
        done, _ = await asyncio.wait([task], timeout=5)
        return task in done and task.cancelled(), rounds

    stopped, rounds = asyncio.run(main())
    assert stopped and rounds == []


def test_it_times_out_cancelling_what_it_awaited_and_waits_without_a_limit_on_none():
    async def main():
        inner = asyncio.create_task(asyncio.sleep(10))
        with pytest.raises(TimeoutError):
            await wait_for(inner, 0.05)
        await asyncio.sleep(0)
        return inner.cancelled(), await wait_for(asyncio.sleep(0.01, "done"), None)

    assert asyncio.run(main()) == (True, "done")
