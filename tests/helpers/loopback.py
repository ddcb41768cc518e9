"""HTTP to the servers the tests start on loopback, through one client.

`loopback.get()` and its kin build a client for each call, and each client loads the CA bundle into an SSL
context: ~50 ms of CPU here, which the suite's polling loops paid every 0.2 s beside the servers they waited
for (minutes of CPU in all). Without keep-alive, as those calls were: each call opens its own connection, so
a server stopped and started again is never reached through a connection to the one before it."""

from __future__ import annotations

import httpx

_client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

get = _client.get
post = _client.post
delete = _client.delete
request = _client.request
stream = _client.stream

__all__ = ["delete", "get", "post", "request", "stream"]
