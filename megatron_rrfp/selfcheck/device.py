"""The self-check's steps about this GPU and this process: the versions and settings it runs
with (``environment``), whether a stream wait blocks other streams' later work on this GPU
(``queue-serialization``, the hazard the rounds protocol is built for), and whether this
process holds a CUDA context on its own GPU only (``one-context``, run last)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .result import Result


def step_environment(ctx) -> Result:
    import torch

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    name = torch.cuda.get_device_name()
    cdmc = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")
    return Result("environment", "PASS", f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
                                         f"{name}, world {ctx['world']}, CUDA_DEVICE_MAX_CONNECTIONS={cdmc}")


# The probe runs in its own interpreter (CUDA_DEVICE_MAX_CONNECTIONS=1 must be set before CUDA
# starts). Every figure is device time from CUDA events; the host's clock only cross-checks it.
# Every kernel runs once before any clock starts: a kernel's first launch loads its module (lazy
# loading), which can wait for the device, so a first launch behind the long sleep stalled the
# host until the sleep was over and both host-clock readings came out as zero.
_SERIALIZATION_PROBE = r"""
import json, sys, time, torch
device, requested_s = int(sys.argv[1]), float(sys.argv[2])
torch.cuda.set_device(device)  # the rank's own GPU
a, b, c = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
x, y = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
event = lambda: torch.cuda.Event(enable_timing=True)
for s in (a, b, c):
    with torch.cuda.stream(s):
        torch.cuda._sleep(1000); x.add_(1); y.add_(1); event().record()
torch.cuda.synchronize()

def sleep_s(cycles):
    start, end = event(), event()
    with torch.cuda.stream(a):
        start.record(); torch.cuda._sleep(cycles); end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3

sleep_s(int(1e8))  # the clocks up from idle
short, long = int(2e7), int(2e8)
t_short, t_long = sleep_s(short), sleep_s(long)
rate = (long - short) / max(t_long - t_short, 1e-9)  # clock64 cycles per second; launch costs cancel
cycles = int(rate * requested_s)
torch.cuda.synchronize()
t0, ta, tb = event(), event(), event()
host0 = time.monotonic()
with torch.cuda.stream(a):
    t0.record(); torch.cuda._sleep(cycles); ta.record()
c.wait_event(ta)
with torch.cuda.stream(c):
    x.add_(1)
with torch.cuda.stream(b):
    y.add_(1); tb.record()
issued_s = time.monotonic() - host0
tb.synchronize(); host_b_s = time.monotonic() - host0
ta.synchronize(); host_s = time.monotonic() - host0
nominal_hz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) * 1e3  # kHz; 0: unknown
print(json.dumps(dict(requested_s=requested_s, cycles=cycles, rate_hz=rate, nominal_hz=nominal_hz,
                      calibration_s=[t_short, t_long], kernel_s=t0.elapsed_time(ta) / 1e3,
                      b_s=max(0.0, t0.elapsed_time(tb) / 1e3), host_s=host_s, host_b_s=host_b_s,
                      issued_s=issued_s)))
"""
SLEEP_REQUESTED_S = 0.5


def judge_serialization_probe(figures: dict, gpu: str) -> Result:
    """The probe's verdict: FAIL when its clock is not real (the calibrated sleep did not run
    about as long as asked, by CUDA events and by the host's clock, or the measured clock is
    not the device's); else PASS, saying whether stream B waited behind the other stream's wait."""
    requested, kernel, host = figures["requested_s"], figures["kernel_s"], figures["host_s"]
    rate, nominal = figures["rate_hz"], figures["nominal_hz"]
    clock = f"{figures['cycles']} cycles at {rate / 1e9:.3f} GHz measured" + (
        f" (nominal {nominal / 1e9:.3f} GHz)" if nominal else "")
    problems = []
    low, high = (0.2 * nominal, 1.2 * nominal) if nominal else (1e8, 5e9)
    if not low <= rate <= high:
        problems.append(f"the sleep kernel's clock measured {rate / 1e9:.3f} GHz, outside "
                        f"{low / 1e9:.2f}-{high / 1e9:.2f} GHz")
    if not 0.75 * requested <= kernel <= 1.25 * requested:
        problems.append(f"the sleep asked for {requested:.3f} s ran {kernel:.3f} s by CUDA events")
    if not 0.8 * kernel <= host <= kernel + 2.0:
        problems.append(f"the host waited {host:.3f} s for a kernel of {kernel:.3f} s by CUDA events")
    if problems:
        return Result("queue-serialization", "FAIL", f"{gpu}: the probe's timing is not real: "
                                                     f"{'; '.join(problems)} ({clock})")
    serialized = figures["b_s"] >= 0.9 * kernel
    timing = (f"sleep kernel asked for {requested:.3f} s ({clock}), ran {kernel:.3f} s by CUDA events "
              f"(host waited {host:.3f} s)")
    if serialized:
        return Result("queue-serialization", "PASS", f"{gpu}: {timing}; with CUDA_DEVICE_MAX_CONNECTIONS=1 a kernel "
                                                     f"on stream B ended {figures['b_s']:.3f} s after it began, "
                                                     "behind another stream's wait on it: one hardware queue, as "
                                                     "the rounds protocol assumes")
    return Result("queue-serialization", "PASS", f"{gpu}: {timing}; with CUDA_DEVICE_MAX_CONNECTIONS=1 a kernel on "
                                                 f"stream B ended {figures['b_s']:.3f} s after it began: this "
                                                 "GPU/driver did not serialize here (the protocol does not rely on "
                                                 "it either way)")


def step_queue_serialization(ctx) -> Result:
    import torch

    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    gpu = f"GPU {torch.cuda.current_device()}"
    try:
        out = subprocess.run([sys.executable, "-c", _SERIALIZATION_PROBE, str(torch.cuda.current_device()),
                              str(SLEEP_REQUESTED_S)], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return Result("queue-serialization", "FAIL", "the probe hung for 120 s")
    if out.returncode != 0:
        return Result("queue-serialization", "FAIL", f"probe failed: {out.stderr.strip()[-300:]}")
    try:
        figures = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return Result("queue-serialization", "FAIL", f"probe printed no figures: {out.stdout.strip()[-300:]}")
    return judge_serialization_probe(figures, gpu)


def step_one_context(ctx) -> Result:
    import torch

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Result("one-context", "SKIP", f"nvidia-smi unavailable: {exc}")
    mine = {line.split(",")[1].strip() for line in out.stdout.splitlines()
            if line.split(",")[0].strip() == str(os.getpid())}
    if not mine:
        return Result("one-context", "SKIP", "nvidia-smi does not list this process (a PID namespace?)")
    own = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    if len(mine) == 1 and (own in next(iter(mine)) or next(iter(mine)).endswith(own[-12:])):
        return Result("one-context", "PASS", f"one CUDA context, on GPU {torch.cuda.current_device()}")
    return Result("one-context", "FAIL", f"this process has contexts on {sorted(mine)} (own GPU {own}): a thread "
                                         "touched CUDA without torch.cuda.set_device")


__all__ = ["judge_serialization_probe", "step_environment", "step_one_context", "step_queue_serialization"]
