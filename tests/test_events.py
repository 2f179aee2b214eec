"""Measured saves: one event per save, restore and backup replication (ckptcore/events.py), the
figures the layers count into it (ckptcore/_meter.py), the manifest's ``stats``, and the
Prometheus exporter (ckptcore/metrics.py) scraped over its real HTTP endpoint.

Real files on local disk and ``memory://``; no storage layer is mocked.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request

import crc32c
import fsspec
import msgpack
import numpy as np
import pytest

import ckptcore
from ckptcore import (Backup, CheckpointManager, LockTakeoverWarning, RestoreEvent, SaveEvent,
                      SchemaError, TrainingState)

from _support import run_ranks


def _state(step: int = 0, n: int = 3, size: int = 50_000) -> TrainingState:
    rng = np.random.default_rng(7)  # the same bytes for every step: a backup deduplicates them
    return TrainingState(model={f"w{i}": rng.standard_normal(size).astype(np.float32)
                                for i in range(n)}, step=step)


def _nbytes(state: TrainingState) -> int:
    return sum(a.nbytes for a in state.model.values())


@pytest.fixture
def seen():
    got: list = []
    with ckptcore.on_event(got.append):
        yield got


def _manager(root, **kw):
    return CheckpointManager(str(root), save_on_preemption=False, **kw)


def test_save_state_and_load_state_emit_one_event_each_and_log_it(tmp_path, seen, caplog):
    caplog.set_level(logging.INFO, logger="ckptcore.events")
    state = _state(5)
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, state)
    ckptcore.load_state(url)
    save, load = seen
    assert isinstance(save, SaveEvent) and isinstance(load, RestoreEvent)
    assert (save.kind, save.step, save.url, save.error, save.asynchronous) == \
        ("save", 5, url, None, False)
    assert save.bytes == _nbytes(state) and save.bytes_written >= save.bytes
    assert save.shards >= 1 and save.requests >= save.shards + 1  # shards, then the manifest
    assert 0 < save.seconds_blocked == save.seconds_total
    assert (load.step, load.bytes, load.shards, load.bytes_written) == (5, save.bytes,
                                                                        save.shards, 0)
    assert load.requests >= 1
    records = [r for r in caplog.records if r.name == "ckptcore.events"]
    assert len(records) == 2 and records[0].levelno == logging.INFO
    assert records[0].getMessage().startswith(f"save step 5 {url}: blocked ")
    assert records[0].ckptcore_event == save.as_dict()
    assert json.dumps(records[1].ckptcore_event)  # plain values
    # The manifest recorded what the save knew before its commit.
    stats = ckptcore.inspect(url).stats
    assert stats["bytes"] == save.bytes and stats["shards"] == save.shards
    assert stats["bytes_written"] == save.bytes_written and stats["asynchronous"] is False
    assert 0 <= stats["seconds"] <= save.seconds_total


def test_a_failed_save_and_load_are_events_with_the_error_type(tmp_path, seen):
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, _state(1))
    with pytest.raises(ckptcore.CheckpointExistsError):
        ckptcore.save_state(url, _state(1))
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(str(tmp_path / "nothing"))
    assert [(e.kind, e.error) for e in seen] == [
        ("save", None), ("save", "CheckpointExistsError"), ("restore", "CheckpointNotFoundError")]


def test_async_save_blocks_less_than_it_takes_and_records_it(tmp_path, seen):
    state = _state(0, n=4, size=400_000)
    with _manager(tmp_path / "run", async_save=True) as mgr:
        handle = mgr.save(10, state)
        handle.result()
        mgr.save(20, state).result()
    saves = [e for e in seen if e.kind == "save"]
    assert [e.step for e in saves] == [10, 20]  # one event each: save_state's is the manager's
    for e in saves:
        assert e.asynchronous and e.error is None and e.bytes == _nbytes(state)
        assert e.root == str(tmp_path / "run") and e.url == mgr.step_url(e.step)
        assert 0 < e.seconds_blocked < e.seconds_total
    stats = ckptcore.inspect(mgr.step_url(20)).stats
    assert stats["asynchronous"] is True and stats["bytes"] == _nbytes(state)


def test_a_group_save_and_restore_is_one_event_per_rank(tmp_path, seen):
    root = str(tmp_path / "run")
    state = _state(3, n=4, size=1000)

    def work(g):
        with _manager(root, group=g) as mgr:
            mgr.save(3, state)
            mgr.restore()
        return "ok"

    assert run_ranks(ckptcore.ThreadGroup.create(2), work) == {0: "ok", 1: "ok"}
    saves = [e for e in seen if e.kind == "save"]
    restores = [e for e in seen if e.kind == "restore"]
    assert len(saves) == 2 and len(restores) == 2
    assert {e.bytes for e in saves} == {_nbytes(state)} == {e.bytes for e in restores}
    # Each rank reports what it wrote: together, the checkpoint's shards.
    assert sum(e.shards for e in saves) == len(ckptcore.inspect(f"{root}/step-000000000003").shards)


def test_backup_events_dedup_and_lag_down_to_zero(tmp_path, seen):
    state = _state()
    with _manager(tmp_path / "run", backup=Backup(str(tmp_path / "bucket"))) as mgr:
        mgr.save(1, state)
        mgr.wait()
        mgr.save(2, state)  # the same bytes: every blob is in the backup already
        mgr.wait()
        assert mgr.backup.lag().steps == 0 and mgr.backup.lag().seconds == 0
    saves = [e for e in seen if e.kind == "save"]
    backups = [e for e in seen if e.kind == "backup"]
    assert [e.step for e in backups] == [1, 2]
    for e in saves:  # committed locally, handed to the backup, not replicated yet
        (lag,) = e.replication_lag
        assert lag.url == str(tmp_path / "bucket") and lag.steps >= 1
    first, second = backups
    assert first.tier == str(tmp_path / "bucket") and first.error is None
    assert first.bytes == _nbytes(state) and first.bytes_written >= first.bytes
    assert second.bytes_written == 0 and second.bytes_deduplicated >= second.bytes > 0
    assert second.replication_lag[0].steps == 0 and second.seconds_blocked == 0
    assert second.requests > 0


def test_a_restore_lists_the_step_it_fell_back_over(tmp_path, seen):
    with _manager(tmp_path / "run") as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        shard = next(p for p in (tmp_path / "run" / "step-000000000002").iterdir()
                     if p.name.startswith("shard-"))
        data = bytearray(shard.read_bytes())
        data[100] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.warns(ckptcore.CheckpointFallbackWarning):
            mgr.restore()
    (event,) = [e for e in seen if e.kind == "restore"]
    assert event.step == 1 and event.tier == "local" and event.error is None
    (fallback,) = event.fallbacks
    assert (fallback.step, fallback.reason, fallback.error) == (2, "invalid",
                                                                "CorruptCheckpointError")
    assert fallback.url == mgr.step_url(2)


def test_a_lease_taken_over_is_in_the_save_event(seen):
    fs = fsspec.filesystem("memory")
    fs.pipe("/evt-takeover/run/.ckptcore.lock", json.dumps(
        {"holder": "gone:1:deadbeef", "host": "gone", "pid": 1, "token": "deadbeef",
         "expires": time.time() - 60, "heartbeat": time.time() - 90}).encode())
    try:
        with _manager("memory://evt-takeover/run") as mgr:
            with pytest.warns(LockTakeoverWarning):
                mgr.save(1, _state(1, n=1, size=10))
            mgr.save(2, _state(2, n=1, size=10))
    finally:
        fs.rm("/evt-takeover", recursive=True)
    first, second = [e for e in seen if e.kind == "save"]
    (takeover,) = first.takeovers
    assert "gone:1:deadbeef" in takeover and "expired" in takeover
    assert second.takeovers == ()


def test_a_raising_callback_is_logged_and_never_breaks_a_save(tmp_path, seen, caplog):
    def broken(event):
        raise RuntimeError("monitoring is down")

    with ckptcore.on_event(broken):
        info = ckptcore.save_state(str(tmp_path / "a"), _state(1, n=1, size=10))
    assert info.step == 1 and len(seen) == 1  # the other callbacks still ran
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "raised on the save event of step 1" in record.getMessage()
    assert "monitoring is down" in caplog.text  # its traceback


def test_unregistering_stops_the_events(tmp_path):
    got: list = []
    sub = ckptcore.on_event(got.append)
    assert sub.active
    ckptcore.save_state(str(tmp_path / "a"), _state(1, n=1, size=10))
    sub.remove()
    sub.remove()  # twice: nothing
    assert not sub.active
    ckptcore.save_state(str(tmp_path / "b"), _state(2, n=1, size=10))
    with ckptcore.on_event(got.append) as again:
        ckptcore.save_state(str(tmp_path / "c"), _state(3, n=1, size=10))
    assert not again.active
    ckptcore.save_state(str(tmp_path / "d"), _state(4, n=1, size=10))
    assert [e.step for e in got] == [1, 3]
    with pytest.raises(TypeError, match="callable"):
        ckptcore.on_event("print")


def _rewrite_stats(path, stats) -> None:
    """The manifest at ``path`` with ``stats`` in its body (its checksum made right again)."""
    outer = msgpack.unpackb(path.read_bytes(), raw=False)
    body = msgpack.unpackb(outer["body"], raw=False, strict_map_key=False)
    body["stats"] = stats
    outer["body"] = msgpack.packb(body, use_bin_type=True)
    outer["body_crc32c"] = crc32c.crc32c(outer["body"])
    path.write_bytes(msgpack.packb(outer, use_bin_type=True))


@pytest.mark.parametrize("stats, why", [
    ("fast", "is a str, not a map"), ({"bytes": -1}, "'bytes' is -1"),
    ({"shards": True}, "'shards' is True"), ({"seconds": float("nan")}, "'seconds' is nan"),
    ({"asynchronous": 1}, "'asynchronous' is 1, not a bool")])
def test_malformed_stats_are_a_schema_error(tmp_path, stats, why):
    url = tmp_path / "ckpt"
    ckptcore.save_state(str(url), _state(1, n=1, size=10))
    _rewrite_stats(url / "manifest.msgpack", stats)
    with pytest.raises(SchemaError, match=why):
        ckptcore.load_state(str(url))


def test_unknown_stats_fields_are_dropped(tmp_path):
    url = tmp_path / "ckpt"
    ckptcore.save_state(str(url), _state(1, n=1, size=10))
    _rewrite_stats(url / "manifest.msgpack", {"bytes": 40, "gpu_seconds": [1, 2]})
    assert ckptcore.inspect(str(url)).stats == {"bytes": 40}


def test_the_prometheus_endpoint_serves_the_counters(tmp_path):
    pytest.importorskip("prometheus_client")
    state = _state(n=1, size=1000)
    with ckptcore.metrics.start_exporter(port=0) as exporter:
        with _manager(tmp_path / "run", backup=Backup(str(tmp_path / "bucket"))) as mgr:
            mgr.save(7, state)
            mgr.wait()
            mgr.restore()
        with pytest.raises(ckptcore.CheckpointNotFoundError):
            ckptcore.load_state(str(tmp_path / "nothing"))
        url = f"http://127.0.0.1:{exporter.port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert series['ckptcore_operations_total{kind="save",outcome="ok"}'] == 1
    assert series['ckptcore_operations_total{kind="backup",outcome="ok"}'] == 1
    assert series['ckptcore_operations_total{kind="restore",outcome="ok"}'] == 1
    assert series['ckptcore_operations_total{kind="restore",outcome="CheckpointNotFoundError"}'] == 1
    assert series['ckptcore_bytes_total{kind="save"}'] == _nbytes(state)
    assert series['ckptcore_written_bytes_total{kind="save"}'] >= _nbytes(state)
    assert series['ckptcore_seconds_count{kind="save"}'] == 1
    assert series['ckptcore_last_step{kind="save"}'] == 7
    assert series[f'ckptcore_replication_lag_steps{{backup="{tmp_path / "bucket"}"}}'] == 0
    assert series['ckptcore_requests_total{kind="save"}'] > 0
    # Closed: unsubscribed and no longer listening.
    assert ckptcore.events.registered() == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)
