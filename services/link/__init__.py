"""``diloco link``: a shaped TCP link between a client and nats-server.

* ``pacing`` — when bytes cross: the rate as a serial line, delay and jitter (pure);
* ``proxy`` — ``LinkProxy``: the TCP proxy, its counters and outages;
* ``service`` — the ``diloco link`` process: the proxy plus its status record;
* ``settings`` — ``LinkSettings``.
"""
