"""One worker of a MultiWorkerMirroredStrategy cluster on 127.0.0.1, exercising
ckptcore_keras.process_group(): ``python _keras_group_worker.py RANK PORTS OUT MODE``.

MODE ``protocol``: rounds of gather/broadcast/barrier with payloads of every kind; rank 0 writes
what it saw to OUT/rank0.json.  MODE ``kill``: after one good round, rank 1 SIGKILLs itself while
rank 0 waits in a gather (timeout 5 s); rank 0 writes the error it got and how long it took.  MODE ``sharded``: each worker saves its
blocks of the sharded state of tests/_sharded_globals.py to the URL in ``CKPT_TEST_URL`` (S3
options in ``CKPT_TEST_S3_OPTIONS``) through the group.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> None:
    rank, ports, out, mode = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4]
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": rank}})
    import tensorflow as tf

    import ckptcore
    import ckptcore_keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    group = ckptcore_keras.process_group(strategy)
    report = {"rank": group.rank, "size": group.size,
              "is_protocol": isinstance(group, ckptcore.ProcessGroup)}
    if mode == "protocol":
        payloads = [b"", bytes([rank]) * (rank * 1000 + 1), os.urandom(0) + b"\x00" * 7,
                    bytes(range(256)) * (4096 * (rank + 1)) + b"tail%d" % rank]  # up to 2 MiB
        gathered = []
        for i, p in enumerate(payloads):
            got = group.gather(p, timeout=30)
            gathered.append(None if got is None else [g.hex()[:64] + f"/{len(g)}" for g in got])
            if got is not None:
                report.setdefault("gather_exact", True)
                expected = [_payload(r, i) for r in range(group.size)]
                report["gather_exact"] &= got == expected
            b = group.broadcast(b"from zero %d" % i * (i + 1) if rank == 0 else None, timeout=30)
            report.setdefault("broadcast_exact", True)
            report["broadcast_exact"] &= b == b"from zero %d" % i * (i + 1)
            group.barrier(timeout=30)
        for i in range(20):  # many small rounds, in order
            got = group.gather(b"%d:%d" % (rank, i), timeout=30)
            if got is not None:
                report["rounds_exact"] = report.get("rounds_exact", True) and got == [
                    b"%d:%d" % (r, i) for r in range(group.size)]
        report["single_group"] = type(ckptcore_keras.process_group(
            tf.distribute.get_strategy())).__name__  # the default strategy: one process
    elif mode in ("save", "savekill"):
        _save(group, out, rank, mode, report)
    elif mode == "sharded":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from _sharded_globals import rank_state

        info = ckptcore.save_state(
            os.environ["CKPT_TEST_URL"], rank_state(group.rank, group.size, template=False),
            group=group, storage_options=json.loads(os.environ.get("CKPT_TEST_S3_OPTIONS") or "{}"))
        report["writer"] = info.writer["id"]
    else:
        group.gather(b"ok", timeout=30)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t = time.monotonic()
        try:
            group.gather(b"second", timeout=5)
            report["error"] = None
        except ckptcore.GroupError as e:
            report["error"] = type(e).__name__
            report["message"] = str(e)
            report["timeout_error"] = isinstance(e, TimeoutError)
        report["seconds"] = time.monotonic() - t
        try:
            group.barrier(timeout=5)
        except ckptcore.GroupError as e:
            report["after"] = type(e).__name__
    if rank == 0:
        with open(os.path.join(out, "rank0.json"), "w") as f:
            json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # the coordination service would otherwise wait for the killed peer at exit


def _save(group, out: str, rank: int, mode: str, report: dict) -> None:
    """Every worker saves the same (mirrored) model and optimizer through the group: chief-free,
    each writes its share.  ``savekill``: a first save commits; then worker 1 is SIGKILLed while
    worker 0 is inside the second save, which must fail (no commit) within the group timeout."""
    import keras
    import numpy as np

    import ckptcore
    from ckptcore import _knobs

    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(32),
                              keras.layers.Dense(4)])
    opt = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(0).standard_normal((32, 8)).astype("float32")
    model.fit(x, x[:, :4], epochs=1, batch_size=16, verbose=0)
    root = os.path.join(out, "ck")
    info = ckptcore.save_state(root, model=model, optimizer=opt, group=group, overwrite=True)
    report["writer"] = info.writer["id"]
    if mode == "save":
        if rank == 0:
            report["saved_weights"] = [w.tolist() for w in model.get_weights()]
        return
    group.barrier(timeout=30)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    model.fit(x, x[:, :4], epochs=1, batch_size=16, verbose=0)  # the state moves on
    t = time.monotonic()
    with _knobs.override(group_timeout=5.0):
        try:
            ckptcore.save_state(root, model=model, optimizer=opt, group=group, overwrite=True)
            report["second"] = "committed"
        except ckptcore.GroupError as e:
            report["second"] = type(e).__name__
    report["seconds"] = time.monotonic() - t
    report["newest_writer"] = ckptcore.inspect(root).writer["id"]


def _payload(rank: int, i: int) -> bytes:
    return [b"", bytes([rank]) * (rank * 1000 + 1), b"\x00" * 7,
            bytes(range(256)) * (4096 * (rank + 1)) + b"tail%d" % rank][i]


if __name__ == "__main__":
    main()
