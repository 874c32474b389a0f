"""GPU utilization from NVML GPM, read through a stand-in for `pynvml` (the real one is read on the H200s:
benchmarks/telemetry_check.py): the arithmetic, the window bookkeeping, and a reason wherever a figure is
missing."""

from types import SimpleNamespace

import pytest
import torch

from tunewright_jobs.gpu_activity import (
    ANY_TENSOR_UTIL,
    DRAM_BW_UTIL,
    SM_UTIL,
    GpuActivity,
    GpuActivitySampler,
    pack,
    unpack_sum,
)

CUDA = torch.device("cuda", 0)


class FakeNvml:
    """GPM counters that advance by `per_window` percent-seconds per window; kernel-active samples."""

    NVML_GPM_METRICS_GET_VERSION = 1

    def __init__(self, supported=True, percents=None, kernel_samples=((10, 99), (20, 97)), fail_init=None):
        self.supported, self.fail_init = supported, fail_init
        self.percents = percents or {SM_UTIL: 71.0, ANY_TENSOR_UTIL: 52.5, DRAM_BW_UTIL: 18.0}
        self.kernel_samples = list(kernel_samples)
        self.taken, self.freed, self.shut = 0, 0, False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError(self.fail_init)

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index):
        return "handle"

    def nvmlDeviceGetName(self, handle):
        return "NVIDIA A10"

    def nvmlGpmQueryDeviceSupport(self, handle):
        return SimpleNamespace(isSupportedDevice=int(self.supported))

    def nvmlGpmSampleAlloc(self):
        return {"at": None}

    def nvmlGpmSampleFree(self, sample):
        self.freed += 1

    def nvmlGpmSampleGet(self, handle, sample):
        self.taken += 1
        sample["at"] = self.taken

    def c_nvmlGpmMetricsGet_t(self):
        return SimpleNamespace(metrics=[SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)])

    def nvmlGpmMetricsGet(self, request):
        assert request.sample2["at"] > request.sample1["at"], "the window runs from the older sample to the newer"
        for metric in request.metrics[:request.numMetrics]:
            metric.value = self.percents[metric.metricId]

    def nvmlDeviceGetSamples(self, handle, kind, since):
        samples = [SimpleNamespace(timeStamp=t, sampleValue=SimpleNamespace(uiVal=v))
                   for t, v in self.kernel_samples if t > since]
        return 0, samples


@pytest.fixture
def cuda_uuid(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="abc"))


class Clock:
    """Seconds that pass only when a test says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sampler_with(nvml, **kwargs) -> tuple[GpuActivitySampler, Clock]:
    clock = Clock()
    return GpuActivitySampler(CUDA, nvml=nvml, clock=clock, **kwargs), clock


def test_a_window_reads_the_gpm_shares_and_the_kernel_active_samples(cuda_uuid):
    nvml = FakeNvml()
    sampler, clock = sampler_with(nvml)
    clock.now += 1.0
    first = sampler.read()
    assert first == GpuActivity(sm_active_share=0.71, tensor_active_share=0.525, dram_bandwidth_share=0.18,
                                kernel_active_share=0.98)
    nvml.kernel_samples.append((30, 50))
    clock.now += 1.0
    second = sampler.read()  # the next window starts where the last ended: only the new sample counts
    assert second.kernel_active_share == 0.5 and second.sm_active_share == 0.71
    assert nvml.taken == 3
    sampler.close()
    assert nvml.freed == 2 and nvml.shut


@pytest.mark.parametrize(("device", "nvml", "enabled", "reason"), [
    (torch.device("cpu"), FakeNvml(), True, "a CPU run: no GPU to read"),
    (CUDA, FakeNvml(), False, "not read: metrics.gpu_activity is off"),
    (CUDA, FakeNvml(fail_init="NVML Shared Library Not Found"), True,
     "NVML could not be read here: NVML Shared Library Not Found"),
    (CUDA, FakeNvml(supported=False), True, "NVIDIA A10 has no GPM counters (NVIDIA Hopper and newer)"),
])
def test_a_missing_figure_says_why(cuda_uuid, device, nvml, enabled, reason):
    reading = GpuActivitySampler(device, nvml=nvml, enabled=enabled).read()
    assert reading.sm_active_share is None and reading.unavailable == reason


def test_windows_shorter_than_the_counters_resolve_are_merged_into_the_next_and_say_so(cuda_uuid):
    """GPM's counters refresh about every 100 ms: 38 ms steps read one by one gave 0.26 (most windows
    exactly 0) where a 1 s sampler read 0.66 on one H200. Short windows are never closed: the one that
    reaches the minimum covers them all, from the one start sample."""
    nvml = FakeNvml()
    sampler, clock = sampler_with(nvml, min_window=0.5)
    readings = []
    for _ in range(16):
        clock.now += 0.064
        readings.append(sampler.read())
    closed = [i for i, r in enumerate(readings) if r.sm_active_share is not None]
    assert closed == [7, 15]  # 8 x 64 ms = 512 ms: the first window long enough, then the next
    assert all(r.unavailable.startswith("merged into a later record: ") and "500 ms" in r.unavailable
               for i, r in enumerate(readings) if i not in closed)
    assert readings[7].sm_active_share == 0.71 and nvml.taken == 3  # one start sample, two ends


def test_kernel_active_is_read_even_without_gpm(cuda_uuid):
    sampler, clock = sampler_with(FakeNvml(supported=False))
    clock.now += 1.0
    reading = sampler.read()
    assert reading.kernel_active_share == 0.98 and reading.sm_active_share is None


def test_ranks_average_what_they_read_and_skip_what_they_did_not():
    read = GpuActivity(0.8, 0.6, 0.2, 1.0)
    missing = GpuActivity(kernel_active_share=0.5, unavailable="no GPM")
    summed = [a + b for a, b in zip(pack(read), pack(missing), strict=True)]
    assert unpack_sum(summed) == pytest.approx([0.8, 0.6, 0.2, 0.75])
    assert unpack_sum(pack(GpuActivity(unavailable="CPU"))) == [None, None, None, None]
