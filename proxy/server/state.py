"""What the server keeps of a configuration beyond the request path: the reload watcher's key,
and freeing a replaced version. The parts a request uses (`Services`, `Runtime`) are the
pipeline's inputs and live below it, in proxy/pipeline/services.py."""

from __future__ import annotations

import sys

from aiohttp import web

from proxy.pipeline.services import Runtime
from proxy.server.reload import ConfigWatcher


def release_runtime(runtime: Runtime) -> None:
    """Free a replaced version nothing else holds one entry at a time (in a worker thread):
    its key index and users, 30,000 and 10,000 entries, would otherwise be freed in one
    cascade that holds the GIL for hundreds of milliseconds. A part that a request still holds
    on its own (it kept `runtime.config`, say) is left whole, to be freed when it lets go."""
    # References to each part: the runtime's field and the argument of getrefcount.
    if sys.getrefcount(runtime.users) <= 2:
        runtime.users.release()
    if sys.getrefcount(runtime.config) <= 2 and sys.getrefcount(runtime.config.users) <= 2:
        # The model is frozen, its dict is not; no one can see this version any more.
        users = runtime.config.users
        while users:
            users.popitem()


WATCHER = web.AppKey("watcher", ConfigWatcher[Runtime])
