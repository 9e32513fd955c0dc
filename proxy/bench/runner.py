"""The load: closed-loop concurrency or open-loop Poisson rate, swept over load levels and prompt
sizes, optionally against two endpoints interleaved; plus the load generator's own health.

Interleaving (`compare`): each level is cut into `rounds` blocks per endpoint, run one after the
other in the order A B B A A B B A ..., so a drift of the machine's speed during the level hits
both endpoints alike. Rates and throughputs are over the time each endpoint was under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from proxy.bench.client import Endpoint, Level, RequestSpec, send
from proxy.bench.stats import Comparison, LevelStats, RequestResult, aggregate, compare, percentile
from proxy.bench.workload import Prompt, generate_prompts, poisson_arrivals

LAG_INTERVAL_S = 0.005
TICK_S = 0.5  # --duration: the progress is reported at least this often


@dataclass(frozen=True)
class BenchConfig:
    endpoints: Sequence[Endpoint]  # one, or two for a comparison (the first is the base)
    spec: RequestSpec
    concurrency: Sequence[int] = (1,)
    rates: Sequence[float] = ()  # requests/s; when given, open loop instead of concurrency
    prompt_tokens: Sequence[int] = (128,)
    prompts: Sequence[Prompt] | None = None  # a prompts file: replaces generated prompts
    requests: int | None = 32  # per endpoint per level
    duration_s: float | None = None  # per endpoint per level, instead of a request count
    warmup: int = 2  # requests per endpoint before anything is measured
    rounds: int | None = None  # blocks per endpoint per level; default 4 comparing, else 1
    slo: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    lag_warn_ms: float = 5.0
    max_connections: int | None = None  # open loop: cap on requests in flight (None: no cap)

    @property
    def mode(self) -> str:
        return "rate" if self.rates else "concurrency"

    @property
    def loads(self) -> list[float]:
        return [float(x) for x in (self.rates or self.concurrency)]

    @property
    def sizes(self) -> list[int]:
        return [0] if self.prompts is not None else list(self.prompt_tokens)

    @property
    def blocks(self) -> int:
        return self.rounds or (4 if len(self.endpoints) > 1 else 1)


@dataclass(frozen=True)
class BenchResult:
    levels: list[LevelStats]
    comparisons: list[Comparison]
    results: list[RequestResult]  # every measured request, warm-up excluded
    warnings: list[str]
    loop: str
    wall_s: float


@dataclass(frozen=True, slots=True)
class Tick:
    """Where a run is, for a progress display: the level's place in the sweep (0 of N during
    the warm-up), the block's requests done and errors, and with --duration the seconds the
    level has run of the seconds it will run (all endpoints' blocks together)."""

    label: str
    level: int
    levels: int
    done: int
    total: int  # requests of the block; 0 with --duration
    errors: int
    elapsed_s: float
    duration_s: float | None


Progress = Callable[[Tick], None]


class LagMonitor:
    """Sleeps `interval` over and over and records by how much each wake-up was late: the time
    every timestamp of ours may be late by, because the loop was busy elsewhere."""

    def __init__(self, interval: float = LAG_INTERVAL_S) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        now = time.perf_counter
        while True:
            t = now()
            await asyncio.sleep(self.interval)
            self.samples.append(max(0.0, now() - t - self.interval))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def take(self) -> list[float]:
        out, self.samples = self.samples, []
        return out

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _block_order(endpoints: int, rounds: int) -> list[int]:
    if endpoints == 1:
        return [0] * rounds
    order: list[int] = []
    for r in range(rounds):
        order += [0, 1] if r % 2 == 0 else [1, 0]
    return order


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class _Prompts:
    def __init__(self, prompts: Sequence[Prompt]) -> None:
        self._cycle = itertools.cycle(prompts)

    def next(self) -> Prompt:
        return next(self._cycle)


@dataclass(frozen=True)
class _Block:
    """One block of a level for one endpoint: `count` requests, or as many as `duration`
    seconds allow (None: no such bound), labelled `label` in the progress report."""

    index: int  # the endpoint's, in config.endpoints and in Runner.sessions
    endpoint: Endpoint
    level: Level
    prompts: _Prompts
    count: int | None
    duration: float | None
    label: str


class Runner:
    def __init__(self, config: BenchConfig, progress: Progress | None = None) -> None:
        if not config.endpoints or len(config.endpoints) > 2:
            raise ValueError("one endpoint, or two to compare")
        if (config.requests is None) == (config.duration_s is None):
            raise ValueError("give either a request count or a duration per level")
        self.config = config
        self.progress = progress
        self.lag = LagMonitor()
        self.sessions: list[aiohttp.ClientSession] = []
        self._position = 0  # the level running, 1-based (0: the warm-up)

    def _pool(self, size: int, count: int) -> list[Prompt]:
        if self.config.prompts is not None:
            return list(self.config.prompts)
        return generate_prompts(size, self.config.spec.model, max(1, min(count, 256)),
                                self.config.seed)

    async def run(self) -> BenchResult:
        cfg = self.config
        t_start = time.perf_counter()
        limit = 0 if cfg.rates else max(cfg.concurrency)
        if cfg.max_connections:
            limit = cfg.max_connections
        for _ in cfg.endpoints:
            connector = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300)
            self.sessions.append(aiohttp.ClientSession(connector=connector))
        self.lag.start()
        results: list[RequestResult] = []
        levels: list[LevelStats] = []
        try:
            await self._warmup()
            for size in cfg.sizes:
                pool = self._pool(size, cfg.requests or 256)
                for load in cfg.loads:
                    self._position += 1
                    level = await self._level(load, size, pool)
                    for stats, rs in level:
                        levels.append(stats)
                        results.extend(rs)
        finally:
            await self.lag.stop()
            for s in self.sessions:
                await s.close()
        comparisons = []
        if len(cfg.endpoints) == 2:
            by_key: dict[tuple[float, int], list[LevelStats]] = {}
            for st in levels:
                by_key.setdefault((st.load, st.prompt_tokens), []).append(st)
            comparisons = [compare(a, b) for a, b in by_key.values()]
        warnings = sorted({w for st in levels for w in st.warnings})
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        return BenchResult(levels, comparisons, results, warnings, loop,
                           time.perf_counter() - t_start)

    async def _warmup(self) -> None:
        cfg = self.config
        if cfg.warmup <= 0:
            return
        size = cfg.sizes[0]
        pool = self._pool(size, cfg.warmup)
        width = max(1, min(cfg.warmup, int(max(cfg.concurrency))))
        for i, endpoint in enumerate(cfg.endpoints):
            prompts = _Prompts(pool)
            level = Level(float(width), size, time.perf_counter())
            await self._closed(_Block(i, endpoint, level, prompts, cfg.warmup, None, "warm-up"))
        self.lag.take()

    async def _level(
        self, load: float, size: int, pool: list[Prompt]
    ) -> list[tuple[LevelStats, list[RequestResult]]]:
        cfg = self.config
        n_ep = len(cfg.endpoints)
        order = _block_order(n_ep, cfg.blocks)
        counts = [_split(cfg.requests, cfg.blocks) if cfg.requests is not None else None
                  for _ in range(n_ep)]
        seen = [0] * n_ep
        per_ep: list[list[RequestResult]] = [[] for _ in range(n_ep)]
        busy = [0.0] * n_ep
        cpu = [0.0] * n_ep
        lags: list[list[float]] = [[] for _ in range(n_ep)]
        prompts = [_Prompts(pool) for _ in range(n_ep)]
        t_origin = time.perf_counter()
        for index in order:
            endpoint = cfg.endpoints[index]
            block = seen[index]
            seen[index] += 1
            count = counts[index][block] if counts[index] is not None else None  # type: ignore[index]
            duration = cfg.duration_s / cfg.blocks if cfg.duration_s is not None else None
            label = self._label(endpoint, load, size)
            self.lag.take()
            c0, t0 = time.process_time(), time.perf_counter()
            todo = _Block(index, endpoint, Level(load, size, t_origin), prompts[index], count,
                          duration, label)
            if cfg.rates:
                rs = await self._open(todo, random.Random(f"{cfg.seed}:{load}:{block}"))
            else:
                rs = await self._closed(todo)
            busy[index] += time.perf_counter() - t0
            cpu[index] += time.process_time() - c0
            lags[index].extend(self.lag.take())
            per_ep[index].extend(rs)
        out = []
        for i, endpoint in enumerate(cfg.endpoints):
            lag_p99 = percentile(lags[i], 99) * 1000 if lags[i] else math.nan
            lag_max = max(lags[i]) * 1000 if lags[i] else math.nan
            cpu_fraction = cpu[i] / busy[i] if busy[i] else math.nan
            warnings = []
            if lag_p99 > cfg.lag_warn_ms:
                warnings.append(
                    f"event-loop lag p99 {lag_p99:.1f} ms > {cfg.lag_warn_ms:g} ms at "
                    f"{self._label(endpoint, load, size)}: TTFT and ITL figures are unreliable "
                    "(the load generator is the bottleneck)")
            if cpu_fraction > 0.9:
                warnings.append(
                    f"load generator used {cpu_fraction:.0%} of a core at "
                    f"{self._label(endpoint, load, size)}: its figures may be limited by itself")
            stats = aggregate(per_ep[i], endpoint=endpoint.label, mode=cfg.mode, load=load,
                              prompt_tokens=size, duration_s=busy[i], slo=cfg.slo,
                              lag_p99_ms=lag_p99, lag_max_ms=lag_max, cpu_fraction=cpu_fraction,
                              warnings=warnings)
            out.append((stats, per_ep[i]))
        return out

    def _label(self, endpoint: Endpoint, load: float, size: int) -> str:
        what = f"rate={load:g}/s" if self.config.rates else f"c={load:g}"
        prompt = f" prompt={size}" if size else ""
        return f"{endpoint.label} {what}{prompt}"

    def _report(self, block: _Block, done: int, errors: int) -> None:
        if self.progress is None:
            return
        cfg = self.config
        total_s = (cfg.duration_s * len(cfg.endpoints)
                   if cfg.duration_s is not None and self._position else None)
        self.progress(Tick(block.label, self._position, len(cfg.sizes) * len(cfg.loads), done,
                           block.count or 0, errors, time.perf_counter() - block.level.t_origin,
                           total_s))

    async def _closed(self, block: _Block) -> list[RequestResult]:
        """`block` from int(load) workers, each sending its next request when one is done."""
        session, spec = self.sessions[block.index], self.config.spec
        endpoint, prompts, count = block.endpoint, block.prompts, block.count
        duration = block.duration
        results: list[RequestResult] = []
        deadline = time.perf_counter() + duration if duration is not None else math.inf
        issued = 0
        errors = 0

        async def worker() -> None:
            nonlocal issued, errors
            while (count is None or issued < count) and time.perf_counter() < deadline:
                issued += 1
                r = await send(session, endpoint, spec, prompts.next(), block.level)
                results.append(r)
                errors += not r.ok
                self._report(block, len(results), errors)

        async with self._ticking(block, results):
            await asyncio.gather(*(worker() for _ in range(int(block.level.load))))
        return results

    @contextlib.asynccontextmanager
    async def _ticking(self, block: _Block, results: list[RequestResult]
                       ) -> AsyncIterator[None]:
        """With --duration, report the progress every TICK_S even while no request ends, so
        the seconds shown keep counting through long streams."""
        if self.progress is None or block.duration is None:
            yield
            return

        async def tick() -> None:
            while True:
                await asyncio.sleep(TICK_S)
                self._report(block, len(results), sum(not r.ok for r in results))

        task = asyncio.create_task(tick())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _open(self, block: _Block, rng: random.Random) -> list[RequestResult]:
        """`block` sent at Poisson arrival times, `load` per second on average."""
        session, spec = self.sessions[block.index], self.config.spec
        endpoint, count, duration = block.endpoint, block.count, block.duration
        results: list[RequestResult] = []
        tasks: list[asyncio.Task[None]] = []
        errors = 0
        t0 = time.perf_counter()

        async def one(prompt: Prompt) -> None:
            nonlocal errors
            r = await send(session, endpoint, spec, prompt, block.level)
            results.append(r)
            errors += not r.ok
            self._report(block, len(results), errors)

        async with self._ticking(block, results):
            for i, offset in enumerate(poisson_arrivals(block.level.load, rng)):
                if (count is not None and i >= count) or (
                        duration is not None and offset >= duration):
                    break
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(block.prompts.next())))
            await asyncio.gather(*tasks)
        return results


async def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    return await Runner(config, progress).run()
