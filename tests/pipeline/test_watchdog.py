"""The watchdog's sweep (proxy.pipeline.watchdog), on watches whose clocks are set back by
hand: an upstream silent past its idle timeout is closed; a relay waiting on its client is not
the upstream's silence, and a client that reads nothing past the write timeout is cut."""

from __future__ import annotations

import pytest

from proxy.pipeline.watchdog import Watchdog

pytestmark = pytest.mark.unit


def test_a_silent_upstream_is_closed_once() -> None:
    closed: list[str] = []
    dog = Watchdog()
    with dog.watch(lambda: closed.append("up"), 1.0) as watch:
        dog.sweep()
        assert not watch.expired and closed == []
        watch.last -= 2.0  # the last read, 2 s ago
        dog.sweep()
        dog.sweep()
        assert watch.expired and closed == ["up"]
    watch.last -= 10.0
    dog.sweep()  # no longer watched
    assert closed == ["up"]


def test_a_write_the_client_holds_up_is_not_the_upstreams_silence() -> None:
    closed: list[str] = []
    aborted: list[str] = []
    dog = Watchdog()
    with dog.watch(lambda: closed.append("up"), 1.0, write_timeout=5.0,
                   abort_client=lambda: aborted.append("client")) as watch:
        watch.last -= 3.0
        watch.writing = watch.last  # writing for 3 s: within the write timeout
        dog.sweep()
        assert (closed, aborted, watch.expired) == ([], [], False)
        watch.writing -= 3.0  # 6 s now: the client reads nothing
        dog.sweep()
        dog.sweep()
        assert (closed, aborted, watch.client_expired) == ([], ["client"], True)
        watch.writing = 0.0  # the write ended: the upstream's clock restarted at the sweep
        dog.sweep()
        assert not watch.expired
