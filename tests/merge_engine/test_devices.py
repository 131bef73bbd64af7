"""`merge_engine.devices.resolve_device`: the device a user names, checked before any work."""

from __future__ import annotations

import pytest
import torch

from merge_engine.devices import resolve_device
from merge_engine.errors import InvalidDevice, InvalidOption

HAS_CUDA = torch.cuda.is_available()


def test_auto_is_cuda_when_this_torch_sees_a_gpu_else_cpu():
    want = "cuda" if HAS_CUDA else "cpu"
    assert resolve_device(None).type == resolve_device("auto").type == resolve_device(" AUTO ").type == want
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu9", "cuda:x", "nonsense:0"])
def test_a_name_torch_does_not_know_is_a_named_error(name):
    with pytest.raises(InvalidDevice, match="is not a torch device") as caught:
        resolve_device(name)
    assert isinstance(caught.value, InvalidOption) and caught.value.exit_code == 2 and caught.value.path == name


def test_meta_computes_nothing():
    with pytest.raises(InvalidDevice, match="meta holds no values"):
        resolve_device("meta")


def test_cuda_without_a_usable_gpu_says_why():
    """With a CPU-only torch (this machine): the build is named; with CUDA, an index past the GPUs is refused."""
    if torch.version.cuda is None:
        for name in ("cuda", "cuda:0", "cuda:1"):
            with pytest.raises(InvalidDevice, match=r"CPU-only build.*--device cpu"):
                resolve_device(name)
    elif HAS_CUDA:
        count = torch.cuda.device_count()
        assert resolve_device("cuda:0").type == "cuda"
        with pytest.raises(InvalidDevice, match=f"has {count} CUDA device"):
            resolve_device(f"cuda:{count}")
    else:
        with pytest.raises(InvalidDevice, match="sees no CUDA device"):
            resolve_device("cuda")


def test_a_device_type_this_torch_lacks_is_refused():
    if not torch.backends.mps.is_available():
        with pytest.raises(InvalidDevice, match="has no mps device"):
            resolve_device("mps")


def test_a_long_or_multi_line_name_is_echoed_once_on_one_bounded_line():
    name = "gpu9" + "x" * 6000 + "\nFAKE: all checks passed\u202e"
    with pytest.raises(InvalidDevice) as caught:
        resolve_device(name)
    shown = str(caught.value)
    assert "\n" not in shown and "\u202e" not in shown and len(shown) < 1400, shown[:200]
    assert shown.count("gpu9") == 1  # the name once (it was in the message and again in the path)
    assert caught.value.path == name.strip()
