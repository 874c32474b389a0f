"""GPU utilization over a logged window, as the GPU itself counts it (docs/architecture.md, "Telemetry definitions").

- SM-active, tensor-active and DRAM-bandwidth shares from NVML's GPU Performance Monitoring (GPM, Hopper
  and newer, no root needed): the driver's counters between two samples, one at each end of the window, so
  the whole window is covered and nothing runs in between (two NVML calls per window). The counters
  refresh about every 100 ms (NVML's nvmlGpmMetricsGet): a window shorter than `MIN_GPM_WINDOW_SECONDS`
  reads stale counters, so a short window is not closed: it is merged into the next, and the records in
  between say so. On one H200 (benchmarks/results/gpm_window_check_h200_2026-12-04.json), GPT-2's 38 ms
  steps read one by one gave 0.26 with 242 of 396 windows exactly 0, where a 1 s sampler of our own read
  0.66; merged to 0.5 s they read 0.750 against 0.752 (median window error 0.005).
- Kernel-active: NVML's `utilization.gpu`, the share of the driver's sample periods in which any kernel
  ran. A one-thread kernel reads 100%, so it is reported only under that name, never as utilization.

Where a figure cannot be read (a CPU run, no NVML, a GPU without GPM, a sandbox that hides the counters)
the reading holds None and `unavailable` says why. Reading costs the run nothing when it fails: every
NVML error turns into a reason.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

# NVML's GPM metric ids (nvml.h, NVML_GPM_METRIC_*): values are percentages of the window
SM_UTIL, ANY_TENSOR_UTIL, DRAM_BW_UTIL = 2, 5, 10
GPM_METRICS = {"sm_active_share": SM_UTIL, "tensor_active_share": ANY_TENSOR_UTIL,
               "dram_bandwidth_share": DRAM_BW_UTIL}
NVML_GPU_UTILIZATION_SAMPLES = 1  # nvmlSamplingType_t: the driver's kernel-active samples
# a steady load on the H200: windows of 65/130/260/515/1030 ms erred 0.13/0.055/0.019/0.009/0.007 (median)
MIN_GPM_WINDOW_SECONDS = 0.5


@dataclass(frozen=True)
class GpuActivity:
    """One rank's window; shares in [0, 1]."""

    sm_active_share: float | None = None
    tensor_active_share: float | None = None
    dram_bandwidth_share: float | None = None
    kernel_active_share: float | None = None
    unavailable: str | None = None  # why the GPM shares are None

    def values(self) -> list[float | None]:
        return [self.sm_active_share, self.tensor_active_share, self.dram_bandwidth_share, self.kernel_active_share]


def share(percent: float) -> float:
    return min(1.0, max(0.0, percent / 100.0))


def pack(reading: GpuActivity) -> list[float]:
    """The reading as numbers that a sum over ranks keeps apart: per field (value, 1) when read, else (0, 0)."""
    out: list[float] = []
    for value in reading.values():
        out += [value, 1.0] if value is not None else [0.0, 0.0]
    return out


def unpack_sum(summed: list[float]) -> list[float | None]:
    """From the ranks' packed readings summed: per field the mean over the ranks that read it."""
    return [summed[i] / summed[i + 1] if summed[i + 1] else None for i in range(0, len(summed), 2)]



class GpuActivitySampler:
    """Samples this rank's GPU at each window's ends. `nvml` is the `pynvml` module (a stand-in in tests)."""

    def __init__(self, device, nvml=None, enabled: bool = True, min_window: float = MIN_GPM_WINDOW_SECONDS,
                 clock=time.monotonic):
        self.unavailable: str | None = None
        self._nvml = self._handle = self._samples = None
        self._last_kernel_sample = 0
        self._min_window, self._clock = min_window, clock
        self._window_start = clock()
        if not enabled:
            self.unavailable = "not read: metrics.gpu_activity is off"
            return
        if device.type != "cuda":
            self.unavailable = "a CPU run: no GPU to read"
            return
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py
            nvml.nvmlInit()
            self._nvml = nvml
            self._handle = self._device_handle(device)
        except ImportError:
            self.unavailable = "nvidia-ml-py is not installed in the worker image"
            return
        except Exception as err:  # NVMLError and its kin: no driver library, no permission
            self.unavailable = f"NVML could not be read here: {err}"
            return
        try:
            support = nvml.nvmlGpmQueryDeviceSupport(self._handle)
            if not support.isSupportedDevice:
                name = nvml.nvmlDeviceGetName(self._handle)
                self.unavailable = f"{name} has no GPM counters (NVIDIA Hopper and newer)"
                return
            self._samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
            nvml.nvmlGpmSampleGet(self._handle, self._samples[0])
        except Exception as err:
            self.unavailable = f"the GPM counters could not be read here: {err}"
            self._samples = None

    def _device_handle(self, device):
        """NVML's handle of the torch device, by UUID: CUDA_VISIBLE_DEVICES renumbers torch's devices."""
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
        if uuid:
            return self._nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    def _kernel_active(self) -> float | None:
        """Mean of the driver's kernel-active samples since the last window (None when it has none)."""
        try:
            _, samples = self._nvml.nvmlDeviceGetSamples(self._handle, NVML_GPU_UTILIZATION_SAMPLES,
                                                         self._last_kernel_sample)
        except Exception:
            return None
        samples = [s for s in samples if s.timeStamp > self._last_kernel_sample]
        if not samples:
            return None
        self._last_kernel_sample = max(s.timeStamp for s in samples)
        return share(sum(s.sampleValue.uiVal for s in samples) / len(samples))

    def read(self) -> GpuActivity:
        """The window since the last one closed (or since the sampler was made), then a new window starts;
        a window too short for the GPM counters stays open and reads nothing."""
        if self._nvml is None or self._handle is None:
            return GpuActivity(unavailable=self.unavailable)
        if self._samples is None:
            return GpuActivity(kernel_active_share=self._kernel_active(), unavailable=self.unavailable)
        elapsed = self._clock() - self._window_start
        if elapsed < self._min_window:  # too short for the counters: the next read covers this window too
            return GpuActivity(unavailable=f"merged into a later record: {elapsed * 1e3:.0f} ms is shorter than "
                                           f"the {self._min_window * 1e3:.0f} ms the GPU's counters resolve")
        self._window_start += elapsed
        kernel_active = self._kernel_active()
        nvml = self._nvml
        try:
            nvml.nvmlGpmSampleGet(self._handle, self._samples[1])
            request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(GPM_METRICS)
            request.sample1, request.sample2 = self._samples
            for slot, metric in enumerate(GPM_METRICS.values()):
                request.metrics[slot].metricId = metric
            nvml.nvmlGpmMetricsGet(request)
            values = {}
            for slot, field in enumerate(GPM_METRICS):
                metric = request.metrics[slot]
                values[field] = share(metric.value) if metric.nvmlReturn == 0 else None
        except Exception as err:
            log.debug("GPM read failed", exc_info=True)
            return GpuActivity(kernel_active_share=kernel_active, unavailable=f"the GPM counters failed: {err}")
        self._samples.reverse()  # this window's end is the next one's start
        return GpuActivity(**values, kernel_active_share=kernel_active)

    def close(self) -> None:
        if self._nvml is None:
            return
        for sample in self._samples or []:
            with contextlib.suppress(Exception):
                self._nvml.nvmlGpmSampleFree(sample)
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()
