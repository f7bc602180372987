"""NvmlSource against the unmodified pynvml loading the fake libnvidia-ml.so.1 in-process."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator

import pynvml
import pytest
from fake_nvml import GIB, MIB, FakeGpu, Inventory

from kvledger.collect.sources.base import GpuContribution, SourceError
from kvledger.collect.sources.nvml import NvmlSource
from kvledger.domain.facts import GpuProcess


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def source(nvml_inventory, clock) -> Iterator[NvmlSource]:
    src = NvmlSource("auto", retry_initial=5.0, retry_max=20.0, clock=clock)
    yield src
    src.close()


def init_calls(lib: ctypes.CDLL) -> int:
    return ctypes.c_int.in_dll(lib, "fake_nvml_init_calls").value


def eight_gpus() -> Inventory:
    return Inventory(
        gpus=[
            FakeGpu(
                total=80 * GIB,
                reserved=(500 + i) * MIB,
                used=i * GIB,
                uuid=f"GPU-{i:08d}-aaaa",
                procs=[(4000 + i, i * GIB - 10 * MIB)] if i else [],
            )
            for i in range(8)
        ],
        driver_version="550.54.15",
    )


def poll(src: NvmlSource) -> GpuContribution:
    out = src.poll()
    assert isinstance(out, GpuContribution)
    return out


def test_pynvml_struct_sizes_match_the_fake_c_shapes():
    # The C side checks the same numbers with _Static_assert (the build fails otherwise).
    assert ctypes.sizeof(pynvml.c_nvmlMemory_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlMemory_v2_t) == 40
    assert pynvml.c_nvmlMemory_v2_t.total.offset == 8
    assert pynvml.nvmlMemory_v2 == 40 | (2 << 24)
    assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == 24
    assert pynvml.c_nvmlProcessInfo_v3_t.usedGpuMemory.offset == 8
    assert ctypes.sizeof(pynvml.nvmlPciInfo_t) == 68


def test_pynvml_resolves_to_the_fake(source, nvml_inventory, fake_nvml_lib):
    nvml_inventory.write(eight_gpus())
    poll(source)
    # The symbol exists only in the fake: pynvml's library object is our object.
    assert ctypes.c_int.in_dll(pynvml.nvmlLib, "fake_nvml_init_calls").value >= 1


def test_eight_gpus_report_memory_v2_and_processes(source, nvml_inventory):
    nvml_inventory.write(eight_gpus())
    out = poll(source)
    assert out.driver_version == "550.54.15"
    assert [g.index for g in out.gpus] == list(range(8))
    for i, g in enumerate(out.gpus):
        assert g.up and not g.mig
        assert g.name == "NVIDIA H100 80GB HBM3"
        assert g.uuid == f"GPU-{i:08d}-aaaa"
        assert g.total_bytes == 80 * GIB
        assert g.driver_reserved_bytes == (500 + i) * MIB
        assert g.used_bytes == i * GIB
        assert g.free_bytes == 80 * GIB - (500 + i) * MIB - i * GIB
        assert g.processes == ([GpuProcess(4000 + i, i * GIB - 10 * MIB)] if i else [])


def test_nvml_is_initialised_once_not_per_poll(source, nvml_inventory, fake_nvml_lib):
    nvml_inventory.write(eight_gpus())
    before = init_calls(fake_nvml_lib)
    for _ in range(3):
        poll(source)
    assert init_calls(fake_nvml_lib) == before + 1


def test_changed_inventory_is_seen_on_next_poll(source, nvml_inventory):
    inv = eight_gpus()
    nvml_inventory.write(inv)
    assert poll(source).gpus[2].used_bytes == 2 * GIB
    inv.gpus[2].used = 30 * GIB
    inv.gpus[2].procs = [(4002, 20 * GIB), (4100, None)]
    nvml_inventory.write(inv)
    g = poll(source).gpus[2]
    assert g.used_bytes == 30 * GIB
    assert g.processes == [GpuProcess(4002, 20 * GIB), GpuProcess(4100, None)]


def test_gpu_lost_mid_run_is_down_while_others_report(source, nvml_inventory):
    inv = eight_gpus()
    nvml_inventory.write(inv)
    assert all(g.up for g in poll(source).gpus)
    inv.gpus[3].lost = True
    nvml_inventory.write(inv)
    out = poll(source)
    lost = out.gpus[3]
    assert (lost.index, lost.up, lost.uuid, lost.total_bytes, lost.processes) == (3, False, None, None, None)
    others = [g for g in out.gpus if g.index != 3]
    assert len(others) == 7 and all(g.up for g in others)
    assert others[3].used_bytes == 4 * GIB
    inv.gpus[3].lost = False
    nvml_inventory.write(inv)
    assert poll(source).gpus[3].up


def test_any_memory_error_marks_only_that_gpu_down(source, nvml_inventory):
    inv = eight_gpus()
    inv.gpus[5].rc = {"nvmlDeviceGetMemoryInfo_v2": 999}
    nvml_inventory.write(inv)
    out = poll(source)
    assert [g.up for g in out.gpus] == [True] * 5 + [False] + [True] * 2


def test_handle_error_marks_gpu_down(source, nvml_inventory):
    inv = eight_gpus()
    inv.gpus[0].rc = {"nvmlDeviceGetHandleByIndex_v2": pynvml.NVML_ERROR_GPU_IS_LOST}
    nvml_inventory.write(inv)
    out = poll(source)
    assert not out.gpus[0].up and all(g.up for g in out.gpus[1:])


def test_processes_not_supported_is_unknown_not_empty(source, nvml_inventory):
    inv = eight_gpus()
    inv.gpus[1].rc = {"nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_NOT_SUPPORTED}
    nvml_inventory.write(inv)
    out = poll(source)
    assert out.gpus[1].up and out.gpus[1].processes is None
    assert out.gpus[1].used_bytes == 1 * GIB
    assert out.gpus[2].processes == [GpuProcess(4002, 2 * GIB - 10 * MIB)]


def test_unavailable_process_memory_is_none(source, nvml_inventory):
    nvml_inventory.write(Inventory(gpus=[FakeGpu(procs=[(10, None), (11, 5 * MIB)])]))
    assert poll(source).gpus[0].processes == [GpuProcess(10, None), GpuProcess(11, 5 * MIB)]


def test_many_processes_use_the_count_protocol(source, nvml_inventory):
    procs = [(1000 + i, (i + 1) * MIB) for i in range(40)]
    nvml_inventory.write(Inventory(gpus=[FakeGpu(procs=procs)]))
    assert poll(source).gpus[0].processes == [GpuProcess(p, b) for p, b in procs]


def test_v2_struct_version_mismatch_falls_back_to_v1(source, nvml_inventory):
    inv = eight_gpus()
    inv.memory_v2_version = 0x01000028  # an older driver's v2 layout: pynvml's version is refused
    nvml_inventory.write(inv)
    g = poll(source).gpus[1]
    assert g.up
    assert g.driver_reserved_bytes is None  # v1 has no such field: unknown, not zero
    assert g.used_bytes == 1 * GIB + 501 * MIB  # v1 used includes the driver's reservation
    assert g.total_bytes == 80 * GIB
    assert g.free_bytes == 80 * GIB - 501 * MIB - 1 * GIB


def test_v2_function_missing_falls_back_to_v1(source, nvml_inventory):
    inv = eight_gpus()
    inv.rc = {"nvmlDeviceGetMemoryInfo_v2": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
    nvml_inventory.write(inv)
    out = poll(source)
    assert all(g.up and g.driver_reserved_bytes is None for g in out.gpus)


def test_mig_parent_is_marked_and_instance_processes_are_collected(source, nvml_inventory):
    mig_gpu = FakeGpu(
        name="NVIDIA A100-SXM4-80GB",
        used=20 * GIB,
        mig=True,
        max_mig=7,
        procs=[],
        migs={
            0: FakeGpu(total=10 * GIB, used=3 * GIB, procs=[(700, 3 * GIB)]),
            # slot 1 empty: NVML says NOT_FOUND, the source skips it
            2: FakeGpu(total=20 * GIB, used=17 * GIB, procs=[(701, 9 * GIB), (700, 8 * GIB)]),
        },
    )
    nvml_inventory.write(Inventory(gpus=[FakeGpu(), mig_gpu]))
    out = poll(source)
    plain, g = out.gpus
    assert not plain.mig
    assert g.up and g.mig and g.name == "NVIDIA A100-SXM4-80GB"
    assert g.used_bytes == 20 * GIB  # the parent's own memory figures
    # PID 700 holds memory in two instances: summed per host PID.
    assert sorted(g.processes, key=lambda p: p.pid) == [GpuProcess(700, 11 * GIB), GpuProcess(701, 9 * GIB)]


def test_mig_device_handles_through_pynvml(source, nvml_inventory):
    nvml_inventory.write(Inventory(gpus=[FakeGpu(mig=True, max_mig=2, migs={1: FakeGpu(total=GIB)})]))
    poll(source)  # initialises NVML
    parent = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 2
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    assert pynvml.nvmlDeviceIsMigDeviceHandle(parent).value == 0
    assert pynvml.nvmlDeviceGetMemoryInfo(mig, version=pynvml.nvmlMemory_v2).total == GIB
    assert pynvml.nvmlDeviceGetPciInfo_v3(parent).busId == "00000000:01:00.0"


def test_mig_turned_on_between_polls(source, nvml_inventory):
    inv = Inventory(gpus=[FakeGpu(procs=[(5, GIB)])])
    nvml_inventory.write(inv)
    assert not poll(source).gpus[0].mig
    inv.gpus[0].mig = True
    inv.gpus[0].procs = []
    inv.gpus[0].migs = {0: FakeGpu(procs=[(5, GIB)])}
    nvml_inventory.write(inv)
    g = poll(source).gpus[0]
    assert g.mig and g.processes == [GpuProcess(5, GIB)]


def test_driver_not_loaded_then_bounded_reinit(nvml_inventory, monkeypatch, fake_nvml_lib, clock):
    monkeypatch.delenv("FAKE_NVML_INVENTORY")
    src = NvmlSource("auto", retry_initial=5.0, retry_max=20.0, clock=clock)
    try:
        with pytest.raises(SourceError) as err:
            src.poll()
        assert err.value.reason == "driver"
        assert "Driver Not Loaded" in err.value.message
        assert src.available()  # a library with a broken driver is present (and news)
        calls = init_calls(fake_nvml_lib)
        # The driver appears; polls before the backoff expires fail fast without nvmlInit.
        monkeypatch.setenv("FAKE_NVML_INVENTORY", str(nvml_inventory.path))
        nvml_inventory.write(eight_gpus())
        clock.now += 4.0
        with pytest.raises(SourceError):
            src.poll()
        assert init_calls(fake_nvml_lib) == calls
        clock.now += 6.0
        assert len(src.poll().gpus) == 8
        assert init_calls(fake_nvml_lib) == calls + 1
    finally:
        src.close()


def test_reinit_backoff_doubles_up_to_the_bound(nvml_inventory, monkeypatch, fake_nvml_lib, clock):
    monkeypatch.delenv("FAKE_NVML_INVENTORY")
    src = NvmlSource("true", retry_initial=5.0, retry_max=20.0, clock=clock)
    attempts = []
    for _ in range(120):  # 120 polls, one a second
        before = init_calls(fake_nvml_lib)
        with pytest.raises(SourceError):
            src.poll()
        if init_calls(fake_nvml_lib) > before:
            attempts.append(clock.now - 1000.0)
        clock.now += 1.0
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[:3] == [5.0, 10.0, 20.0] and set(gaps[3:]) == {20.0}


def test_forced_init_error_reports_nvml_string(nvml_inventory):
    inv = eight_gpus()
    inv.rc = {"nvmlInitWithFlags": pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH}
    nvml_inventory.write(inv)
    src = NvmlSource()
    with pytest.raises(SourceError) as err:
        src.poll()
    assert err.value.reason == "driver"
    assert "version mismatch" in err.value.message and "18" in err.value.message


def test_device_count_failure_fails_the_source_and_reinitialises(source, nvml_inventory, fake_nvml_lib):
    inv = eight_gpus()
    inv.rc = {"nvmlDeviceGetCount_v2": pynvml.NVML_ERROR_UNKNOWN}
    nvml_inventory.write(inv)
    with pytest.raises(SourceError) as err:
        source.poll()
    assert err.value.reason == "driver" and "nvmlDeviceGetCount" in err.value.message
    inv.rc = {}
    nvml_inventory.write(inv)
    before = init_calls(fake_nvml_lib)
    assert len(source.poll().gpus) == 8
    assert init_calls(fake_nvml_lib) == before + 1


def test_zero_gpus(source, nvml_inventory):
    nvml_inventory.write(Inventory(gpus=[]))
    assert poll(source).gpus == []


def test_disabled_source():
    src = NvmlSource("false")
    assert not src.available()
    with pytest.raises(SourceError) as err:
        src.poll()
    assert err.value.reason == "disabled"


def test_bad_enabled_value():
    with pytest.raises(ValueError, match="auto, true, false"):
        NvmlSource("yes")
