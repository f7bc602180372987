"""The ``nvml`` source: GPU memory, processes and MIG state from NVML via pynvml.

Uses the unmodified pynvml of ``nvidia-ml-py`` (pinned). NVML is initialised once,
lazily on the first poll, and kept initialised; a failed initialisation is retried on
later polls with exponential backoff (``retry_initial`` doubling up to ``retry_max``
seconds), in between a poll fails fast with the last error.

Per GPU it reports name, UUID, memory v2 (total, driver reserved, used, free) with a
fallback to v1 when the driver does not take the v2 struct (then the reservation is
unknown and ``used`` includes it), compute processes (host PIDs and bytes; ``None``
when NVML cannot tell), and MIG mode. A GPU whose handle or memory query fails
(GPU_IS_LOST, or any error) is reported ``up=False`` while the others keep reporting.

Failures of the whole source are ``SourceError`` with reason:
- ``absent``: ``enabled="auto"`` and libnvidia-ml.so.1 cannot be loaded: no GPU stack
  here. ``available()`` returns False in that case so the collector can leave the
  source out instead of reporting it down forever.
- ``library``: the library cannot be loaded although ``enabled="true"``, or it lacks a
  function pynvml needs (NVMLError_FunctionNotFound / NVMLLibraryMismatchError).
- ``driver``: nvmlInit or a system-level call failed (DriverNotLoaded, NVML/RM
  version mismatch, NoPermission, Uninitialized, ...); the message carries NVML's
  error string.
- ``disabled``: ``enabled="false"`` (a collector should not poll it at all).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from kvledger.collect.sources.base import GpuContribution, Source, SourceError
from kvledger.domain.facts import GpuFacts, GpuProcess

log = logging.getLogger(__name__)

T = TypeVar("T")

ENABLED_VALUES = ("auto", "true", "false")
_NA_U64 = 0xFFFFFFFFFFFFFFFF
_NA_U32 = 0xFFFFFFFF
# Errors meaning "this driver does not take the v2 memory struct": fall back to v1.
_V2_UNSUPPORTED = {
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NOT_SUPPORTED,
}


class _GpuDown(Exception):
    """Internal: this GPU cannot be read now (lost, or its memory query failed)."""


def _nvml_text(exc: BaseException) -> str:
    """NVML's error string for an NVMLError (pynvml's __str__ asks nvmlErrorString)."""
    if isinstance(exc, pynvml.NVMLError):
        return f"{exc} (NVML error {exc.value})"
    return str(exc) or type(exc).__name__


class NvmlSource(Source):
    """Node-wide GPU facts (``engine=""``)."""

    kind = "nvml"
    engine = ""

    def __init__(
        self,
        enabled: str = "auto",
        *,
        retry_initial: float = 1.0,
        retry_max: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if enabled not in ENABLED_VALUES:
            raise ValueError(f"nvml.enabled must be one of {', '.join(ENABLED_VALUES)}; got {enabled!r}")
        self.enabled = enabled
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._clock = clock
        self._lock = threading.Lock()
        self._initialized = False
        self._driver_version: str | None = None
        self._init_error: SourceError | None = None
        self._next_init_at = 0.0
        self._backoff = retry_initial
        self._v1_only: set[int] = set()  # GPU indexes whose driver refused the v2 struct
        self._warned: set[str] = set()

    # ------------------------------------------------------------ lifecycle

    def available(self) -> bool:
        """False when this source has nothing to watch: disabled, or (auto) no NVML library.

        Tries to initialise NVML once (respecting the retry backoff); a driver failure
        still counts as available: the GPU stack is there and broken, which is news.
        """
        if self.enabled == "false":
            return False
        with self._lock:
            try:
                self._ensure_init()
            except SourceError as exc:
                return exc.reason != "absent"
        return True

    def close(self) -> None:
        with self._lock:
            if self._initialized:
                self._initialized = False
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError as exc:
                    log.warning("nvmlShutdown failed: %s", _nvml_text(exc))

    def _ensure_init(self) -> None:
        if self.enabled == "false":
            raise SourceError("disabled", "the nvml source is disabled by configuration (nvml.enabled: false)")
        if self._initialized:
            return
        now = self._clock()
        if self._init_error is not None and now < self._next_init_at:
            cached = self._init_error  # a fresh exception: no traceback piles up
            raise SourceError(cached.reason, cached.message)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            error = self._init_failure(exc)
        except pynvml.NVMLLibraryMismatchError as exc:
            error = SourceError("library", f"NVML library does not match pynvml: {exc}")
        else:
            try:
                driver = pynvml.nvmlSystemGetDriverVersion()
            except pynvml.NVMLError as exc:
                error = self._lost_init(exc, "nvmlSystemGetDriverVersion")
            else:
                self._initialized = True
                self._driver_version = driver if isinstance(driver, str) else driver.decode()
                self._init_error = None
                self._backoff = self._retry_initial
                self._v1_only.clear()
                return
        self._init_error = error
        self._next_init_at = now + self._backoff
        self._backoff = min(self._backoff * 2, self._retry_max)
        raise error

    def _init_failure(self, exc: pynvml.NVMLError) -> SourceError:
        if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            reason = "absent" if self.enabled == "auto" else "library"
            return SourceError(reason, f"NVML library libnvidia-ml.so.1 could not be loaded: {_nvml_text(exc)}")
        if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            return SourceError("library", f"NVML library lacks a function pynvml needs: {_nvml_text(exc)}")
        return SourceError("driver", f"NVML initialisation failed: {_nvml_text(exc)}")

    def _lost_init(self, exc: pynvml.NVMLError, what: str) -> SourceError:
        """A system-level call failed after init: re-initialise on the next poll."""
        self._initialized = False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass  # already uninitialised (or the driver is gone): nothing to undo
        return SourceError("driver", f"{what} failed: {_nvml_text(exc)}")

    # ------------------------------------------------------------ polling

    def poll(self) -> GpuContribution:
        with self._lock:
            self._ensure_init()
            try:
                count = pynvml.nvmlDeviceGetCount()
            except pynvml.NVMLError as exc:
                raise self._lost_init(exc, "nvmlDeviceGetCount") from None
            gpus = [self._gpu(index) for index in range(count)]
            return GpuContribution(gpus=gpus, driver_version=self._driver_version)

    def _gpu(self, index: int) -> GpuFacts:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            total, reserved, used, free = self._memory(index, handle)
            name = self._optional(pynvml.nvmlDeviceGetName, handle)
            uuid = self._optional(pynvml.nvmlDeviceGetUUID, handle)
            mig_handles = self._mig_handles(handle)
            processes = self._processes(handle, mig_handles)
        except _GpuDown:
            return GpuFacts(index=index, up=False)
        except pynvml.NVMLError as exc:  # the handle itself could not be had
            self._warn_once(f"handle:{index}:{exc.value}", "GPU %d: no handle: %s", index, _nvml_text(exc))
            return GpuFacts(index=index, up=False)
        return GpuFacts(
            index=index,
            up=True,
            uuid=uuid,
            name=name,
            mig=mig_handles is not None,
            total_bytes=total,
            used_bytes=used,
            free_bytes=free,
            driver_reserved_bytes=reserved,
            processes=processes,
        )

    def _memory(self, index: int, handle: Any) -> tuple[int, int | None, int, int]:
        """(total, reserved or None, used, free). With v1, ``used`` includes the reservation."""
        if index not in self._v1_only:
            try:
                m2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                return int(m2.total), int(m2.reserved), int(m2.used), int(m2.free)
            except pynvml.NVMLError as exc:
                if exc.value not in _V2_UNSUPPORTED:
                    self._warn_once(f"mem:{index}:{exc.value}", "GPU %d memory: %s", index, _nvml_text(exc))
                    raise _GpuDown from None
                self._v1_only.add(index)
                log.info("GPU %d: memory v2 not taken (%s); using v1 without the driver reservation",
                         index, _nvml_text(exc))
        try:
            m1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError as exc:
            self._warn_once(f"mem1:{index}:{exc.value}", "GPU %d memory (v1): %s", index, _nvml_text(exc))
            raise _GpuDown from None
        return int(m1.total), None, int(m1.used), int(m1.free)

    def _optional(self, fn: Callable[[Any], T], handle: Any) -> T | None:
        """A per-device fact that may be missing; a lost GPU is down."""
        try:
            return fn(handle)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise _GpuDown from None
            return None

    def _mig_handles(self, handle: Any) -> list[Any] | None:
        """MIG device handles when MIG mode is on (possibly empty), None when off or unsupported."""
        mode = self._optional(pynvml.nvmlDeviceGetMigMode, handle)
        if not mode or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return None
        slots = self._optional(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
        out = []
        for slot in range(slots):
            def mig_handle(h: Any, s: int = slot) -> Any:
                return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, s)

            mig = self._optional(mig_handle, handle)
            if mig is not None:  # NOT_FOUND: an empty slot
                out.append(mig)
        return out

    def _process_list(self, handle: Any) -> list[Any] | None:
        try:
            return list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise _GpuDown from None
            self._warn_once(f"procs:{exc.value}", "GPU processes unknown: %s", _nvml_text(exc))
            return None
        except pynvml.NVMLLibraryMismatchError as exc:
            self._warn_once("procs:mismatch", "GPU processes unknown: %s", exc)
            return None

    def _processes(self, handle: Any, mig_handles: list[Any] | None) -> list[GpuProcess] | None:
        """Compute processes of the GPU; with MIG, the union of the parent's and every instance's.

        Entries are deduplicated by (pid, GPU instance, compute instance) and summed per
        PID; a PID whose bytes any entry cannot tell gets ``None``. None overall when no
        list could be read (e.g. NOT_SUPPORTED).
        """
        lists = [self._process_list(handle)]
        for mig in mig_handles or ():
            try:
                lists.append(self._process_list(mig))
            except _GpuDown:
                lists.append(None)  # one lost instance does not take the whole GPU down
        known = [entries for entries in lists if entries is not None]
        if not known:
            return None
        seen: set[tuple[int, int, int]] = set()
        by_pid: dict[int, int | None] = {}
        for entries in known:
            for p in entries:
                key = (int(p.pid), int(p.gpuInstanceId), int(p.computeInstanceId))
                if key in seen:
                    continue
                seen.add(key)
                used = p.usedGpuMemory
                if used is None or used == _NA_U64:
                    by_pid[key[0]] = None
                elif key[0] not in by_pid:
                    by_pid[key[0]] = int(used)
                elif (so_far := by_pid[key[0]]) is not None:
                    by_pid[key[0]] = so_far + int(used)
        return [GpuProcess(pid=pid, used_bytes=used) for pid, used in by_pid.items()]

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)
