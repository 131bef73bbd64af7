"""The torch-free dtype table (`merge_engine.formats.dtype_names`) says what torch and safetensors say.

A check reads dtypes by name and proves byte sizes from this table; the read path resolves the names
to ``torch.dtype`` s. So the table must agree with the installed torch on every dtype (name, alias,
item size, typed-storage class) and with the safetensors library on every code it shares, and a name
must resolve to the very ``torch.dtype`` object torch uses. A pickled dtype compared with a
``torch.dtype`` raises instead of answering False (a silent False would be a silent wrong merge).
"""

from __future__ import annotations

import warnings

import pytest
import safetensors.torch
import torch

from merge_engine.formats import dtype_names
from merge_engine.formats.dtype_names import PickledDType, name_of, torch_dtype
from merge_engine.formats.torch_archive import TorchArchive


def _torch_dtypes() -> dict[str, list[str]]:
    """canonical name -> every attribute name of torch spelling it."""
    names: dict[str, list[str]] = {}
    for attr, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            names.setdefault(str(value).removeprefix("torch."), []).append(attr)
    return names


def test_every_torch_dtype_is_in_the_table_with_its_item_size_and_aliases():
    spelled = _torch_dtypes()
    assert set(dtype_names.ITEMSIZES) == set(spelled)
    for name, attrs in spelled.items():
        assert dtype_names.ITEMSIZES[name] == getattr(torch, name).itemsize, name
        for attr in attrs:
            assert dtype_names.canonical(attr) == name
            assert torch_dtype(attr) is getattr(torch, name)
            assert name_of(getattr(torch, attr)) == name
    assert {a for attrs in spelled.values() for a in attrs} - set(spelled) == set(dtype_names.ALIASES)


def test_storage_classes_are_torch_typed_storages():
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy typed-storage classes warn on attribute access
        for attr in dir(torch):
            if attr.endswith("Storage") and attr not in ("Storage", "TypedStorage", "UntypedStorage"):
                try:
                    found[attr] = str(getattr(torch, attr).dtype).removeprefix("torch.")
                except Exception:  # quantized storages without a plain dtype
                    continue
    assert {k: v for k, v in dtype_names.STORAGE_CLASSES.items() if k != "UntypedStorage"} == found
    assert dtype_names.STORAGE_CLASSES["UntypedStorage"] == "uint8"


def test_safetensors_codes_are_the_libraries_own():
    library = safetensors.torch._TYPES
    for code, name in dtype_names.SAFETENSORS_CODES.items():
        assert library[code] is torch_dtype(name), code
    from merge_engine.formats.safetensors_file import CODES, DTYPES

    assert CODES == {library[code]: code for code in dtype_names.SAFETENSORS_CODES}
    assert DTYPES == {code: library[code] for code in dtype_names.SAFETENSORS_CODES}


def test_a_pickled_dtype_refuses_comparison_with_a_torch_dtype():
    bf16 = PickledDType("bfloat16")
    assert bf16 == PickledDType("bfloat16") and bf16 != PickledDType("float16")
    assert PickledDType("half") == PickledDType("float16") and bf16.itemsize == 2
    with pytest.raises(TypeError):
        bf16 == torch.bfloat16  # noqa: B015 - the comparison itself is what is tested
    with pytest.raises(TypeError):
        torch.bfloat16 == bf16  # noqa: B015
    with pytest.raises(TypeError):
        bf16 != torch.float32  # noqa: B015
    with pytest.raises(KeyError):
        PickledDType("float33")
    with pytest.raises(TypeError):
        name_of(3)


def test_records_read_from_an_archive_resolve_to_torch_dtypes(tmp_path):
    """Every dtype torch.save writes comes back, by name, as the ``torch.dtype`` torch.load gives."""
    saved = {str(d): torch.arange(3).to(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                                    torch.uint8, torch.bool, torch.int8, torch.complex64)}
    path = tmp_path / "dtypes.pt"
    torch.save(saved, path)
    loaded = torch.load(path)
    tree = TorchArchive(str(path)).load()
    for key, tensor in loaded.items():
        assert tree[key].dtype_name == key.removeprefix("torch.")
        assert tree[key].dtype is tensor.dtype
        assert tree[key].itemsize == tensor.dtype.itemsize
        assert torch.equal(tree[key].read().view(torch.uint8), tensor.view(torch.uint8))
