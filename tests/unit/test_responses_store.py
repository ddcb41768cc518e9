"""gateway/responses_store.py: responses kept per tenant, bounded by last use and expiring, in this process or
in a real Redis that every front shares (a damaged entry there is a miss)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from unittest.mock import ANY

import redis

from kvgate.gateway.responses_store import KeptItem, MemoryResponses, RedisResponses, ResponseStore, Stored


def test_the_store_is_a_bounded_lru_with_a_ttl_per_tenant():
    now = [0.0]
    store = MemoryResponses(max_count=2, ttl_s=10.0, clock=lambda: now[0])

    async def expire() -> None:
        now[0] = 10.5

    asyncio.run(bounded_lru_with_a_ttl_per_tenant(store, expire))
    assert len(store) == 0 and not store.holders


def test_the_redis_store_is_the_same_bounded_lru_shared_by_every_front(redis_url):
    async def check() -> None:
        one, two = (RedisResponses(redis_url, max_count=2, ttl_s=1.0) for _ in range(2))
        await bounded_lru_with_a_ttl_per_tenant(one, lambda: asyncio.sleep(1.2))
        await one.put("a", Stored({"id": "r5", "output": [{"id": "fc_5"}]}, [{"role": "user", "content": "hi"}], "p"))
        found = await two.get("a", "r5")  # another front
        assert found.messages == [{"role": "user", "content": "hi"}] and found.items == ("fc_5",)
        assert (await two.held("a", ["fc_5"]))[0] == KeptItem({"id": "fc_5"}, "r5", "p")
        await one.redis.set(one.entry(one.scope("a"), "r5"), b"{not json")  # damaged: a miss, never an answer
        assert await two.get("a", "r5") is None
        await one.close()
        await two.close()

    asyncio.run(check())
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.zcard("kvgate:resp:used") <= 2  # the order of use is bounded as the entries are
        assert not raw.keys("kvgate:resp:*:i:fc_1")  # gone with their response


def test_items_go_with_the_latest_response_that_holds_them():
    asyncio.run(items_go_with_the_latest_response_that_holds_them(MemoryResponses()))


def test_in_redis_items_go_with_the_latest_response_that_holds_them(redis_url):
    async def check() -> None:
        store = RedisResponses(redis_url)
        await items_go_with_the_latest_response_that_holds_them(store)
        await store.put("a", Stored({"id": "r3", "output": [{"id": "fc_3"}]}, [], "p", [{"id": "msg_3"}]))
        await store.redis.set(store.item(store.scope("a"), "msg_3"), b"r3\n{not json")  # damaged: a miss
        assert await store.held("a", ["msg_3", "fc_3"]) == [None, KeptItem({"id": "fc_3"}, "r3", "p")]
        await store.close()

    asyncio.run(check())


def test_the_items_of_the_responses_kept_in_this_process_are_bounded():
    store = MemoryResponses(max_count=10, max_items=3)

    async def check() -> None:
        await store.put("a", Stored({"id": "r1", "output": [{"id": "m1"}]}, [], None, [{"id": "u1"}]))
        await store.put("a", Stored({"id": "r2", "output": [{"id": "m2"}]}, [], None, [{"id": "u2"}]))
        assert await store.get("a", "r1") is None and len(store.holders) == 2  # r1 went: 4 items are too many
        assert await store.held("a", ["u1", "u2", "m2"]) == [None, KeptItem({"id": "u2"}, "r2", None), ANY]

    asyncio.run(check())


async def items_go_with_the_latest_response_that_holds_them(store: ResponseStore) -> None:
    """Input and output items alike are found by id; an item a later response holds too (referred to) stays
    with it when the first goes."""
    message, call = {"id": "msg_1", "type": "message"}, {"id": "fc_1"}
    await store.put("a", Stored({"id": "r1", "output": [call]}, [], "p", [message]))
    assert await store.held("a", ["msg_1", "fc_1"]) == [KeptItem(message, "r1", "p"), KeptItem(call, "r1", "p")]
    assert await store.held("b", ["msg_1"]) == [None]  # another tenant's
    await store.put("a", Stored({"id": "r2", "output": []}, [], "p", [call, {"id": "msg_2"}]))
    assert await store.delete("a", "r1")
    assert await store.held("a", ["msg_1", "fc_1"]) == [None, KeptItem(call, "r2", "p")]
    assert await store.delete("a", "r2") and await store.held("a", ["fc_1", "msg_2"]) == [None, None]


async def bounded_lru_with_a_ttl_per_tenant(store: ResponseStore, expire: Callable[[], Awaitable[None]]) -> None:
    """What every store keeps; `expire()` lets every response kept so far outlive the store's TTL."""

    async def put(tenant: str, response_id: str, *items: str) -> None:
        output = [{"id": i} for i in items]
        await store.put(tenant, Stored({"id": response_id, "output": output}, [], f"p-{response_id}"))

    await put("a", "r1", "fc_1")
    await put("b", "r1")
    assert await store.held("a", ["msg_x", "fc_1"]) == [None, KeptItem({"id": "fc_1"}, "r1", "p-r1")]  # not a use
    assert await store.held("b", ["fc_1"]) == [None]
    assert await store.get("b", "r1") is not None and (await store.get("a", "r1")).program == "p-r1"  # two tenants
    await put("a", "r2")  # over the count: b's r1, used least recently, goes
    assert await store.get("b", "r1") is None and await store.get("a", "r1") is not None
    await put("a", "r3")  # r2 goes: r1 was used since
    assert await store.get("a", "r2") is None and (await store.held("a", ["fc_1"]))[0].response == "r1"
    await expire()
    await put("a", "r4")  # the expired go, r4 stays
    assert await store.get("a", "r1") is None and await store.held("a", ["fc_1"]) == [None]
    assert await store.get("a", "r4") is not None
    assert await store.delete("a", "r4") and not await store.delete("a", "r4")
    assert await store.get("a", "r4") is None
