"""Which CPU this is, as the kernel plan's cache keys and the benchmarks name it."""

from __future__ import annotations

import platform
from pathlib import Path

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags that change which kernels win
# bf16 dot products in hardware (AMX tiles; AVX-512 BF16's VDPBF16PS), best first: without one, a bf16 product is
# converted to fp32 in software and runs slower than fp32 itself
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_model() -> str:
    """The CPU as the cache keys name it (describe_cpu of /proc/cpuinfo; platform's name elsewhere)."""
    try:
        return describe_cpu(Path("/proc/cpuinfo").read_text())
    except OSError:
        return platform.processor() or platform.machine()


def native_bf16_isa(cpuinfo: str | None = None) -> str | None:
    """The first of NATIVE_BF16_FLAGS the CPU has (`cpuinfo`: /proc/cpuinfo text, default this machine's), or None
    (none, or no /proc/cpuinfo to say)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = _first_cpu_fields(cpuinfo).get("flags", "").split()
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


def describe_cpu(cpuinfo: str) -> str:
    """The model name of the first processor in /proc/cpuinfo text, then its family / model / stepping and the
    vector extensions that change which kernels win. The model name alone is not enough: a virtual machine may
    show "AMD EPYC" for parts as different as an AVX2-only one and one with AVX-512 and bf16 dot products, whose
    plans differ."""
    fields = _first_cpu_fields(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine()
    ids = ", ".join(f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if fields.get(k))
    isa = " ".join(f for f in ISA_FLAGS if f in fields.get("flags", "").split())
    detail = "; ".join(x for x in (ids, isa) if x)
    return f"{name} ({detail})" if detail else name


def _first_cpu_fields(cpuinfo: str) -> dict[str, str]:
    """The "key: value" fields of the first processor in /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields
