"""`tokenmeter bench`: a load generator for OpenAI-compatible endpoints (see proxy.bench.cli)."""

from proxy.bench.client import Endpoint, RequestSpec
from proxy.bench.runner import BenchConfig, BenchResult, run_bench
from proxy.bench.stats import Dist, LevelStats, RequestResult

__all__ = ["BenchConfig", "BenchResult", "Dist", "Endpoint", "LevelStats", "RequestResult",
           "RequestSpec", "run_bench"]
