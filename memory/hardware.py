"""What this machine can run: torch's devices, the CPU's bfloat16 units, the ``auto`` profile.

Probed when a profile is picked or a model loads, never when a profile is parsed, so a
profile file means the same on every machine.  torch is imported only inside the
probes: without it this machine is a CPU.
"""

from __future__ import annotations

from pathlib import Path


def detect_accelerator() -> str:
    """Return ``cuda``, ``mps`` or ``cpu``: the best device torch can see here."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


# CPU flags under which the 0.6B Qwen reranker is fast in bfloat16: AMX on x86 (with
# only AVX512-BF16 it is slower in bfloat16 than in float32: 14 s against 10 s of CPU
# for 20 candidates on a 2-core Xeon, BENCHMARKS.md), bf16 on ARM.
FAST_BF16_FLAGS = frozenset({"amx_bf16", "bf16"})


def cpu_runs_bf16_fast(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has bfloat16 matrix units, from the kernel's CPU flags.

    x86 lists ``amx_bf16`` in ``flags`` (Sapphire Rapids and later); ARM lists ``bf16``
    in ``Features``.  ``avx512_bf16`` alone does not count: measured, torch's bfloat16
    path is slower there than float32.  Read from ``/proc/cpuinfo`` because torch has
    no public check.

    Returns:
        ``None`` when the flags cannot be read (not Linux).
    """
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(FAST_BF16_FLAGS & set(value.split()))
    return None


def auto_profile_name() -> str:
    """The profile ``auto`` stands for on this machine.

    ``cuda``, then ``mps``; on a CPU-only machine ``cpu`` (the 0.6B Qwen reranker in
    bfloat16, 1.2-3.6 s a search with AMX) only when the CPU has bfloat16 matrix units
    (:func:`cpu_runs_bf16_fast`), and ``cpu-small`` (a small cross-encoder, about half
    a second for 30 candidates on 2 cores) otherwise: without them the 0.6B takes
    10-20 s a search (BENCHMARKS.md).
    """
    accelerator = detect_accelerator()
    if accelerator != "cpu":
        return accelerator
    return "cpu" if cpu_runs_bf16_fast() else "cpu-small"


def missing_device(device: str) -> str | None:
    """Why torch cannot use ``device`` on this machine, or ``None`` when it can.

    Checked before a model loads: a CUDA profile on a machine without CUDA then says
    so in one line, not torch's ``AssertionError: Torch not compiled with CUDA enabled``.
    """
    kind = device.split(":", 1)[0]
    if kind not in ("cuda", "mps"):
        return None
    try:
        import torch
    except ImportError:
        return None  # the loader says that torch is missing
    if kind == "cuda":
        if torch.cuda.is_available():
            return None
        why = "this torch is built without CUDA" if torch.version.cuda is None else (
            "torch sees no CUDA device")
        return f"there is no CUDA here ({why})"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return None
    return "there is no MPS here (torch sees no Apple GPU)"
