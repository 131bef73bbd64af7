"""One executor registry, keyed by address (`merge_engine.output.executors`).

Specification:
- the CLI's and the flows' spellings name addresses: ``--workers N`` is ``threads:N`` (none: ``threads``,
  one per core), ``--ray-address A`` is ``ray:A`` (a Ray Client URL ``ray://host:port`` as it is);
- ``threads:N`` makes N threads here; ``threads`` one per core; a count that is no positive number, or a
  scheme nobody registered, is `InvalidOption` naming the address (and the known schemes);
- ``ray:host:port`` naming no live cluster is `RayClusterUnreachable` from the address check, before Ray is
  asked to connect and before any work (an address that accepts but never answers: after the connect timeout);
- a layer above adds its own scheme in a table it passes (`executor_at`'s ``executors``): the factory gets what
  follows ``<scheme>:``, or the whole address when it is a URL of the scheme; ``run_job`` writes through whatever
  it makes. The engine's table is a literal, read-only: no import adds to it (importing ``tasks.shard_runs``,
  which has its own, included), so the executors an address can name never depend on import order.
"""

from __future__ import annotations

import socket

import pytest

from merge_engine.errors import InvalidOption, RayClusterUnreachable
from merge_engine.output import executors
from merge_engine.output.executors import EXECUTORS, executor_address, executor_at
from merge_engine.output.executors.local import LocalExecutor
from tests.servers import free_ports


@pytest.mark.parametrize("workers, ray_address, address", [
    (None, None, "threads"), (4, None, "threads:4"), (1, None, "threads:1"),
    (None, "auto", "ray:auto"), (2, "local", "ray:local"), (None, "127.0.0.1:6379", "ray:127.0.0.1:6379"),
    (None, "ray://head:10001", "ray://head:10001"),
])
def test_the_options_spellings_name_an_address(workers, ray_address, address):
    assert executor_address(workers, ray_address) == address


def test_threads_here():
    assert executor_at("threads:3").workers == 3 and isinstance(executor_at("threads:3"), LocalExecutor)
    assert executor_at("threads").workers is None


@pytest.mark.parametrize("address, message", [
    ("threads:0", "at least 1"), ("threads:two", "at least 1"), ("threads:-1", "at least 1"),
    ("dask:tcp://scheduler:8786", "no executor is registered for 'dask'; known: .*ray.*threads"),
    ("", "no executor is registered"),
])
def test_an_address_nobody_serves_is_a_named_error(address, message):
    with pytest.raises(InvalidOption, match=message) as info:
        executor_at(address)
    assert info.value.path.startswith(address)


def test_a_dead_ray_address_is_refused_before_ray_is_asked(monkeypatch):
    """Refused by the address check (a refused connection answers at once), before Ray's own connect,
    which retries a dead address for minutes."""
    from merge_engine.output.executors import ray as ray_executor

    asked: list[bool] = []
    monkeypatch.setattr(ray_executor, "import_ray", lambda: asked.append(True) or pytest.fail("Ray was asked"))
    address = f"127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(RayClusterUnreachable, match=address):
        executor_at(f"ray:{address}")
    assert asked == []


def test_an_address_that_never_answers_is_refused_after_the_connect_timeout():
    """Something accepts the connection (the kernel does, for a listening socket nobody serves) but never
    speaks: refused once ``timeout`` has passed, naming it, instead of Ray's minutes of retries."""
    from merge_engine.output.executors.ray_address import check_ray_address

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RayClusterUnreachable, match="no answer within 1 s") as info:
            check_ray_address(address, timeout=1.0)
    assert info.value.path == address


def test_a_layer_above_passes_its_own_executors(tmp_path):
    """What a new executor needs: a factory under a scheme. Its units give the threads' bytes."""
    from merge_engine.commands.merge import MergeJob
    from merge_engine.output.jobs import OutputOptions, run_job
    from tests.merge_engine.output.test_jobs import _contents, _hf_folder

    made: list[str] = []

    class Recording(LocalExecutor):
        def __init__(self, rest: str) -> None:
            made.append(rest)
            super().__init__(2)

    table = {**EXECUTORS, "recording": Recording}
    assert isinstance(executor_at("recording:pool-a", table), Recording)
    assert isinstance(executor_at("recording://host:1", table), Recording)
    assert made == ["pool-a", "recording://host:1"]

    source = _hf_folder(tmp_path)
    ours = run_job(MergeJob(source, str(tmp_path / "a"), OutputOptions(max_shard_size=100)),
                   executor=executor_at("recording:x", table))
    threads = run_job(MergeJob(source, str(tmp_path / "b"), OutputOptions(max_shard_size=100)))
    assert _contents(tmp_path / "a") == _contents(tmp_path / "b") and ours.checksums == threads.checksums


def test_the_engine_table_is_literal_and_read_only():
    """The engine's schemes are the ones written in its table, and the table refuses additions."""
    assert set(executors.EXECUTORS) == {"threads", "ray"}
    with pytest.raises(TypeError):
        executors.EXECUTORS["other"] = LocalExecutor  # type: ignore[index]
    with pytest.raises(InvalidOption, match="no executor is registered for 'prefect-ray'"):
        executor_at("prefect-ray:auto")
