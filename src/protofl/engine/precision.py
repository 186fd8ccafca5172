"""``execution.precision``: the arithmetic format of the clients' local training.

* ``fp32`` (default): everything in float32.
* ``bf16``: the forward pass and the loss of the one training loop
  (:func:`protofl.engine.train.fit`) run under ``torch.autocast`` with
  ``dtype=torch.bfloat16`` (matrix products and convolutions in bfloat16, reductions and
  losses as autocast decides); ``backward`` runs outside the autocast region as PyTorch
  recommends. The weights, their gradients, the optimizer state, every message and the
  aggregation stay float32 (fp32 master weights). Server-side training (CReFF's
  classifier retraining, FedGen's generator), prototypes computed after training
  (``ctx.features``) and evaluation stay float32: evaluation is a measurement and should not
  depend on how the clients trained (benchmarks/timing.md, section 2, "bf16").

bfloat16 pays off only where the hardware has bfloat16 arithmetic (x86 AVX512-BF16 or
AMX, recent GPUs); elsewhere PyTorch converts back and forth and bf16 is slower than
fp32. :func:`bf16_note` says so once at the start of a run.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("protofl")

PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager[None]:
    """The context the forward pass of local training runs in (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX-BF16)."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)  # PyTorch's own (private) CPU feature probes
        try:
            if fn is not None and fn():
                return True
        except Exception:  # a probe that fails says nothing
            pass
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def bf16_note(precision: str, device: str) -> Optional[str]:
    """Why bf16 will be slow on ``device`` (one line), or None (fp32, or native bf16)."""
    if precision != "bf16":
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return (f"execution.precision=bf16: {torch.cuda.get_device_name(dev)} has no native bfloat16; "
                    f"bf16 will be slow (it still runs)")
        return None
    if not cpu_has_bf16():
        return ("execution.precision=bf16: this CPU has neither AVX512-BF16 nor AMX; bf16 will be "
                "slower than fp32 (it still runs)")
    return None


def check_precision(precision: str, device: str) -> None:
    """Log :func:`bf16_note`'s warning, if any (once per run, at its start)."""
    note = bf16_note(precision, device)
    if note:
        log.warning(note)
