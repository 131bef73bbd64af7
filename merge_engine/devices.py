"""The torch device a user names (``--device``, a flow's ``device``), checked before any work is done.

`resolve_device(name)`: None, ``""`` or ``auto`` -> ``cuda`` when this torch sees a CUDA device, else
``cpu``; any other name must be a torch device this machine can use, else `InvalidDevice` (one line
naming the device and why: a CPU-only torch, no GPU visible, an index past the GPUs there, or no such
device type) -- never torch's own ``AssertionError: Torch not compiled with CUDA enabled``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from merge_engine.errors import InvalidDevice

if TYPE_CHECKING:
    import torch

AUTO = ("", "auto")
GPU_SETUP_HINT = "install a CUDA build of torch first (README: GPU workers)"


def resolve_device(name: str | None, option: str = "--device") -> "torch.device":
    """The torch device ``name`` asks for (see the module docstring); `InvalidDevice` when it cannot be used."""
    import torch

    text = (name or "").strip()
    if text.lower() in AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        # the name is echoed once, by the error's path (one bounded line)
        raise InvalidDevice(f"{option} is not a torch device (cpu, cuda, cuda:N, auto)", text) from None
    if device.type == "cpu":
        return device
    if device.type == "meta":
        raise InvalidDevice(f"{option} meta holds no values: nothing can be computed there (cpu, cuda, auto)", text)
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise InvalidDevice(f"{option} {text}: this torch ({torch.__version__}) is a CPU-only build; "
                                f"use --device cpu, or {GPU_SETUP_HINT}", text)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidDevice(f"{option} {text}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA "
                                "device (driver, CUDA_VISIBLE_DEVICES); use --device cpu", text)
        if device.index is not None and device.index >= count:
            raise InvalidDevice(f"{option} {text}: this machine has {count} CUDA device(s), cuda:0 to "
                                f"cuda:{count - 1}", text)
        return device
    if not _available(torch, device.type):
        raise InvalidDevice(f"{option} {text}: this torch ({torch.__version__}) has no {device.type} device here "
                            "(cpu, cuda, auto)", text)
    return device


def _available(torch_module, kind: str) -> bool:
    backend = getattr(torch_module.backends, kind, None)  # mps
    module = getattr(torch_module, kind, None)  # xpu, mtia, ...
    for where in (backend, module):
        check = getattr(where, "is_available", None)
        if callable(check):
            try:
                return bool(check())
            except Exception:  # noqa: BLE001 - a backend that cannot even answer is not available
                return False
    return False
