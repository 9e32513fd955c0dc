"""What a stream tells of its timing: each content chunk, and when it arrived.

A structural type, so that the sans-I/O tap (proxy.protocol.tap) reports to a meter without
importing one: telemetry sits above protocol (it records what protocol parsed), and
proxy.telemetry.meter.RequestMeter, the meter the relay hands the tap, fits this shape.
"""

from __future__ import annotations

from typing import Protocol


class ContentMeter(Protocol):
    def content(self, now: float) -> None:
        """A content chunk arrived at `now` (and has already been written to the client)."""

    def content_run(self, now: float, count: int) -> None:
        """`count` content chunks arrived together at `now`."""
