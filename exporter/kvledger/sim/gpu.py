"""A simulated GPU source: NVML-like facts for the demo's simulated engines.

Each GPU's used memory is the sum of the budget terms the simulated engines declare
on it (weights, workspace, runtime buffers, KV pool; the reserve is headroom, not an
allocation) plus an unaccounted drift that moves over time (seeded), so the
``unaccounted`` figure has something to show.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

from kvledger.collect.sources.base import GpuContribution, Source
from kvledger.domain.facts import GpuFacts, GpuProcess
from kvledger.sim.engine import SimEngine

GiB = 2**30


class SimGpuSource(Source):
    kind = "sim-gpu"
    engine = ""

    def __init__(
        self,
        engines: Sequence[SimEngine],
        *,
        count: int = 2,
        total_bytes: int = 80 * GiB,
        driver_reserved_bytes: int = 512 * 2**20,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engines = list(engines)
        self.count = count
        self.total_bytes = total_bytes
        self.driver_reserved_bytes = driver_reserved_bytes
        self._rng = random.Random(seed)
        self._clock = clock
        self._start = clock()
        self._walk = [0.0] * count

    def poll(self) -> GpuContribution:
        t = self._clock() - self._start
        gpus = []
        for index in range(self.count):
            processes = []
            used = 0
            for engine in self.engines:
                held = sum(b for gpu, category, b, _ in engine.memory_terms if gpu == index and category != "reserve")
                if held:
                    used += held
                    if engine.pid is not None:
                        processes.append(GpuProcess(engine.pid, held))
            self._walk[index] = max(0.0, self._walk[index] + self._rng.gauss(0, 8 * 2**20))
            drift = int(256 * 2**20 + 192 * 2**20 * math.sin(t / 7.0 + index) + self._walk[index])
            used = min(self.total_bytes - self.driver_reserved_bytes, used + max(0, drift))
            gpus.append(
                GpuFacts(
                    index=index,
                    up=True,
                    uuid=f"GPU-5151-0000-0000-{index:012d}",
                    name="Simulated GPU (kvledger demo)",
                    total_bytes=self.total_bytes,
                    used_bytes=used,
                    free_bytes=self.total_bytes - self.driver_reserved_bytes - used,
                    driver_reserved_bytes=self.driver_reserved_bytes,
                    processes=processes,
                )
            )
        return GpuContribution(gpus, driver_version="sim-1.0")
