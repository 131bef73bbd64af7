"""DirectFile: O_DIRECT writes give exactly the bytes written, any length, with or without O_DIRECT support.

Specification: the file holds exactly what was written (unaligned sizes, tails, writes spanning the
staging buffer); where the filesystem refuses O_DIRECT (at open, or at the first write) it falls back
to buffered writes with the same result.
"""

import os

import pytest

from merge_engine.storage import direct_io
from merge_engine.storage.direct_io import DirectFile


@pytest.fixture(autouse=True)
def small_staging(monkeypatch):
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 3 * direct_io.BLOCK)


@pytest.mark.parametrize("sizes", [[0], [1], [4096], [5000, 7, 12288, 3], [40000], [12288, 12288]])
def test_bytes_round_trip(tmp_path, sizes):
    chunks = [os.urandom(n) for n in sizes]
    path = tmp_path / "f.bin"
    f = DirectFile(str(path))
    for chunk in chunks:
        assert f.write(chunk) == len(chunk)
    f.close()
    assert path.read_bytes() == b"".join(chunks)


def _refusing(real, *, at: str):
    """os.open / os.write that fail with EINVAL for O_DIRECT, as filesystems without it do."""
    state = {"direct_fds": set()}

    def fake_open(path, flags, mode=0o777):
        if flags & os.O_DIRECT and at == "open":
            raise OSError(22, "Invalid argument")
        fd = real["open"](path, flags, mode)
        if flags & os.O_DIRECT:
            state["direct_fds"].add(fd)
        else:
            state["direct_fds"].discard(fd)  # fd numbers are reused after close
        return fd

    def fake_write(fd, data):
        if fd in state["direct_fds"] and at == "write":
            raise OSError(22, "Invalid argument")
        return real["write"](fd, data)

    return fake_open, fake_write


@pytest.mark.parametrize("at", ["open", "write"])
def test_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch, at):
    fake_open, fake_write = _refusing({"open": os.open, "write": os.write}, at=at)
    monkeypatch.setattr(direct_io.os, "open", fake_open)
    monkeypatch.setattr(direct_io.os, "write", fake_write)
    data = os.urandom(50000)
    f = DirectFile(str(tmp_path / "f.bin"))
    f.write(data)
    f.close()
    assert not f.direct
    assert (tmp_path / "f.bin").read_bytes() == data


@pytest.mark.parametrize("size", [3 * direct_io.BLOCK, 3 * direct_io.BLOCK + 5, 17])
@pytest.mark.parametrize("at", [None, "write"])
def test_positioned_parts_in_any_order_give_the_file(tmp_path, monkeypatch, size, at):
    """`PositionedFile`: block-sized parts written from threads in reverse order, the last one short,
    give exactly the file, with O_DIRECT or after falling back from it at the first write."""
    import threading

    if at is not None:
        real_pwrite = os.pwrite
        direct_fds: set[int] = set()
        real_open = os.open

        def fake_open(path, flags, mode=0o777):
            fd = real_open(path, flags, mode)
            (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)
            return fd

        def fake_pwrite(fd, data, offset):
            if fd in direct_fds:
                raise OSError(22, "Invalid argument")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(direct_io.os, "open", fake_open)
        monkeypatch.setattr(direct_io.os, "pwrite", fake_pwrite)
    data = os.urandom(size)
    part = direct_io.BLOCK
    f = direct_io.PositionedFile(str(tmp_path / "f.bin"), size)
    threads = []
    for start in reversed(range(0, size, part)):
        buffer = direct_io.aligned_buffer(part)
        buffer[:min(part, size - start)] = data[start:start + part]
        view = memoryview(buffer)[:min(part, size - start)]
        threads.append(threading.Thread(target=f.write_at, args=(start, view)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    f.close()
    assert (tmp_path / "f.bin").read_bytes() == data
    if at is not None:
        assert not f.direct
    with pytest.raises(ValueError):
        direct_io.PositionedFile(str(tmp_path / "g.bin"), 10).write_at(0, b"x" * 11)
