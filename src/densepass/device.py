"""Where and in which precision models run: the default device, bf16 autocast (by default on GPU and on a CPU
with bfloat16 instructions), the precision encoding and scoring run in (``resolve_precision``),
attention kernels, and replayable random states.

Every module that picks a device or a precision asks this one, so a setting means the same thing in
training, pre-training, encoding and serving.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from densepass.config import PRECISIONS
from densepass.errors import ConfigError


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | None) -> torch.device:
    """The device called ``name`` (None: ``default_device()``), checked to exist before any work starts."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device {name!r} is not a torch device (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but this machine has no CUDA GPU (use cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type != "cpu":
        raise ConfigError(f"device {name!r} is not supported (use cpu, cuda or cuda:N)")
    return device


class RandomState:
    """Captures the CPU and CUDA random states so a forward pass can be replayed exactly."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with the captured random states, restoring the current ones afterwards."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """On GPU, scaled-dot-product attention through the flash / memory-efficient kernels (no cuDNN):
    cuDNN builds an execution plan for every new sequence length, which costs seconds over the
    many lengths of length-sorted batches."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


NATIVE_BF16_ENV = "DENSEPASS_NATIVE_BF16"
"""Set to 0 or 1 to override the detection of ``cpu_has_native_bf16`` (0: every ``auto`` stays fp32 on this CPU,
e.g. to reproduce a machine without bf16 instructions; 1: trust a CPU whose flags are hidden)."""


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU computes bfloat16 in hardware (the ``avx512_bf16`` or ``amx_bf16`` flag), where
    bf16 speeds training and encoding up instead of emulating bf16 in float32 (False where unknown;
    ``$DENSEPASS_NATIVE_BF16`` overrides it)."""
    override = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if override in ("0", "1"):
        return override == "1"
    if override:
        raise ConfigError(f"${NATIVE_BF16_ENV} must be 0 or 1, got {override!r}")
    try:
        flags = Path(cpuinfo).read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 natively: a GPU, or a CPU with bf16 instructions."""
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())


def uses_bf16(device: torch.device, bf16: bool, cpu_bf16: bool | str) -> bool:
    """Whether steps on ``device`` autocast to bfloat16: on GPU when ``bf16`` (the default); on CPU when
    ``cpu_bf16`` is true, or ``"auto"`` (the default) and the CPU has native bfloat16 (MiniLM fine-tuning about
    2x and pre-training 2-2.4x faster with AVX512-BF16: docs/benchmarks.md). Forced on a CPU without it, bf16 is
    emulated, with a warning."""
    if device.type == "cuda":
        return bf16
    if device.type != "cpu":
        return False
    if cpu_bf16 == "auto":
        return resolved_cpu_bf16(cpu_bf16)
    if cpu_bf16 and not cpu_has_native_bf16():
        warnings.warn(
            "cpu_bf16: this CPU has no native bfloat16 (avx512_bf16 / amx_bf16), so bf16 autocast "
            "is emulated and likely slower than float32",
            stacklevel=2,
        )
    return bool(cpu_bf16)


def resolved_cpu_bf16(cpu_bf16: bool | str) -> bool:
    """What a ``cpu_bf16`` setting does on this machine's CPU (``"auto"``: whether it has native bfloat16): part
    of a run's identity, so that a run started with bf16 autocast never resumes in fp32 on another CPU."""
    return cpu_has_native_bf16() if cpu_bf16 == "auto" else bool(cpu_bf16)


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision encoding and scoring on ``device`` run in for a ``precision`` setting: ``fp32``, ``bf16``
    or ``int8`` (``auto``: bf16 where the device computes it natively, ``native_bf16``: a GPU, or a CPU with
    AVX512-BF16 / AMX, where MiniLM's bf16 embeddings keep the fp32 ranking (docs/benchmarks.md); else fp32,
    since bf16 is emulated and several times slower on other CPUs). int8 (dynamic quantisation) runs on the
    CPU only."""
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if precision == "int8" and device.type != "cpu":
        raise ConfigError(f"precision int8 (dynamic quantisation) runs on the CPU only; use bf16 on {device.type}")
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        warnings.warn(
            "precision bf16: this CPU has no native bfloat16 (avx512_bf16 / amx_bf16), so it is emulated and "
            "several times slower than fp32",
            stacklevel=2,
        )
    return precision


@contextlib.contextmanager
def autocast_context(device: torch.device, bf16: bool) -> Iterator[None]:
    """bf16 autocast on ``device`` (when ``bf16``; see ``uses_bf16``) with the attention kernels of
    ``attention_kernels``."""
    with attention_kernels(device):
        if bf16 and device.type in ("cuda", "cpu"):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                yield
        else:
            yield
