"""Where and in which precision models run: the default device, bf16 autocast (by default on GPU and on a CPU
where bfloat16 is faster than float32), the precision encoding and scoring run in (``resolve_precision``),
attention kernels, and replayable random states.

Every module that picks a device or a precision asks this one, so a setting means the same thing in
training, pre-training, encoding and serving.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from densepass.config import PRECISIONS
from densepass.errors import ConfigError


@functools.cache
def _glibc():
    """The C library when it is glibc (whose ``malloc_trim`` releases freed heap memory), else None."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)  # the C library this process runs on: no search, no subprocess
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to release this way
        return None
    return libc


def release_freed_memory() -> bool:
    """Give the memory this process has freed back to the system (glibc's ``malloc_trim``); False where the C
    library cannot. CPU training steps of varying shapes (padding-free ones above all: every step a new token
    count) leave glibc's heaps fragmented, and it keeps the freed memory: a process's resident size grows by tens
    of megabytes a step, to gigabytes within an hour, though it holds no more tensors (docs/reliability.md)."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | None) -> torch.device:
    """The device called ``name`` (None: ``default_device()``), checked to exist before any work starts: a CUDA
    index beyond this machine's GPUs and a CPU index other than 0 (``cpu:7``, which torch accepts) are one-line
    ConfigErrors."""
    device = device_named(name)
    if name is None:
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but this machine has no CUDA GPU (use cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type != "cpu":
        raise ConfigError(f"device {name!r} is not supported (use cpu, cuda or cuda:N)")
    elif device.index not in (None, 0):  # torch takes cpu:7, and it is the one CPU device
        raise ConfigError(f"device {name!r}: the CPU has no device index (use cpu)")
    else:
        device = torch.device("cpu")  # cpu:0 is cpu (torch.device("cpu:0") != torch.device("cpu"))
    return device


def device_named(name: str | None) -> torch.device:
    """The device ``name`` names (None: ``default_device()``) without checking that this machine has it: what the
    saved settings of a run made elsewhere meant (a run directory's identity), where ``resolve_device`` would refuse
    a GPU this machine lacks."""
    if name is None:
        return default_device()
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device {name!r} is not a torch device (use cpu, cuda or cuda:N)") from None


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


FAST_BF16_ENV = "DENSEPASS_FAST_BF16"
"""Set to 0 or 1 to override ``cpu_has_fast_bf16``'s reading of the CPU (0: every ``auto`` stays fp32, e.g. to
reproduce a machine without fast bf16; 1: trust a CPU whose flags are hidden)."""


def env_switch(name: str) -> bool | None:
    """The environment variable ``name`` as a switch: 1 (True), 0 (False) or unset / empty (None); anything else
    is a one-line ``ConfigError``."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"${name} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"


def cpu_has_fast_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether bfloat16 is faster than float32 on this CPU, so that ``auto`` settings pick it: with AMX
    (``amx_bf16``: Intel Sapphire Rapids and later) or with AVX512-BF16 on AMD (``avx512_bf16``: Zen 4 and later).
    Intel's AVX512-BF16 without AMX (Cooper Lake, or a Sapphire Rapids VM that hides AMX) is not: there oneDNN's
    bf16 products do no more multiply-adds per cycle than MKL's float32 ones, plus conversions, so encoding and
    training run slower in bf16 (docs/benchmarks.md, "A CPU where bf16 is slower than fp32"). False where
    unknown; ``$DENSEPASS_FAST_BF16`` overrides it."""
    override = env_switch(FAST_BF16_ENV)
    if override is not None:
        return override
    words = cpuinfo_words(cpuinfo)
    return "amx_bf16" in words or ("avx512_bf16" in words and "AuthenticAMD" in words)


@functools.lru_cache(maxsize=8)
def cpuinfo_words(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The words of ``cpuinfo`` (vendor and flags, e.g. ``amx_bf16``), read once per process: every encoding call
    resolves its precision, and /proc/cpuinfo grows with the core count (empty where it cannot be read)."""
    try:
        return frozenset(Path(cpuinfo).read_text().split())
    except OSError:
        return frozenset()


def fast_bf16(device: torch.device) -> bool:
    """Whether bfloat16 is faster than float32 on ``device``: a GPU, or a CPU where ``cpu_has_fast_bf16``."""
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())


SLOW_BF16 = "this CPU has no fast bfloat16 (AMX, or AVX512-BF16 on AMD), so bf16 is likely slower than float32"


def uses_bf16(device: torch.device, bf16: bool, cpu_bf16: bool | str) -> bool:
    """Whether steps on ``device`` autocast to bfloat16: on GPU when ``bf16`` (the default); on CPU when
    ``cpu_bf16`` is true, or ``"auto"`` (the default) and bf16 is faster than float32 there (``cpu_has_fast_bf16``;
    the gain is measured in docs/benchmarks.md). Forced on another CPU, it runs, with a warning."""
    if device.type == "cuda":
        return bf16
    if device.type != "cpu":
        return False
    if cpu_bf16 == "auto":
        return resolved_cpu_bf16(cpu_bf16)
    if cpu_bf16 and not cpu_has_fast_bf16():
        warnings.warn(f"cpu_bf16: {SLOW_BF16}", stacklevel=1)  # one place: shown once per process
    return bool(cpu_bf16)


def resolved_cpu_bf16(cpu_bf16: bool | str) -> bool:
    """What a ``cpu_bf16`` setting does on this machine's CPU (``"auto"``: whether bf16 is fast there): part
    of a run's identity, so that a run started with bf16 autocast never resumes in fp32 on another CPU."""
    return cpu_has_fast_bf16() if cpu_bf16 == "auto" else bool(cpu_bf16)


def resolved_packing(config, device: torch.device, dense: bool) -> bool:
    """Whether a training config's ``packing`` (a ``TrainConfig``) asks for packed steps of a model trained on
    ``device``, ``dense`` when a dense bi-encoder: true or false as set. ``"auto"`` (the default) asks for them where
    they are measured faster than padded ones at the same model quality (docs/benchmarks.md, "Padding-free
    training"): a dense bi-encoder's steps on the CPU without LoRA, gradient checkpointing, gradient caching or FSDP.
    On a GPU, and for SPLADE and ColBERT, packed steps are tested equal but not yet timed. Part of a run's identity,
    so that a run never resumes with the other steps."""
    if config.packing not in (True, False, "auto"):  # the Python API: yaml and --set are checked on loading
        raise ConfigError(f"train.packing: {config.packing!r} is not true, false or auto")
    if config.packing != "auto":
        return bool(config.packing)
    plain = not (config.lora_rank or config.gradient_checkpointing or config.grad_cache_chunk or config.fsdp)
    return device.type == "cpu" and dense and plain


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision encoding and scoring on ``device`` run in for a ``precision`` setting: ``fp32``, ``bf16``
    or ``int8`` (``auto``: bf16 where it is faster than fp32, ``fast_bf16``: a GPU, or a CPU with AMX or AMD's
    AVX512-BF16, where MiniLM's bf16 embeddings keep the fp32 ranking (docs/benchmarks.md); else fp32). int8
    runs on the CPU only."""
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    if precision == "auto":
        return "bf16" if fast_bf16(device) else "fp32"
    if precision == "int8" and device.type != "cpu":
        raise ConfigError(f"precision int8 (int8 products) runs on the CPU only; use bf16 on {device.type}")
    if precision == "bf16" and device.type == "cpu" and not cpu_has_fast_bf16():
        warnings.warn(f"precision bf16: {SLOW_BF16}", stacklevel=1)  # one place: shown once per process
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
