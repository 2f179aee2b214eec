"""The processes of the exact-resume tests, run as ``python _resume.py <command> <dir> ...``.

Commands (see ``test_paddle_resume.py`` for how they are combined):

* ``reference``: uninterrupted runs: a small MNIST CNN in a custom loop (``plain``, saving at each
  epoch end), the same with gradients accumulated over 4 batches (``accum``), and ``paddle.Model.fit``
  with :class:`ckptcore_paddle.Checkpoint` (``fit``).
* ``victim <name>``: the run ``name`` from scratch, checkpointing as it goes; it prints
  ``KILL <batch>`` when the parent should SIGKILL it, and never gets past the end of epoch 1.
* ``resume``: in one fresh process, resumes ``plain`` from the end-of-epoch-0 checkpoint of the
  reference run (a) and from the newest checkpoint of its victim (b), ``accum`` from its victim (c),
  and ``fit`` from its victim; each to the end of epoch 2.
* ``dp <phase> <rank> <port,port>``: one rank of a two-process ``paddle.DataParallel`` job (gloo
  on CPU; it sets the ``PADDLE_*`` variables that ``paddle.distributed.launch`` would, from its
  rank and the two ports); ``elastic``: the same job resumed in one process with the plain model.

Every run writes ``<dir>/<run>.json`` (per-batch losses as float32 bit patterns, what was restored)
and ``<dir>/<run>.npz`` (final parameters and optimizer accumulators through Paddle's own APIs);
victims and DP ranks append one JSON line per batch to ``<dir>/<run>.jsonl`` as they go.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import warnings

warnings.filterwarnings("ignore")
# Several of these processes share the machine's cores; one OpenMP thread each keeps them from
# oversubscribing (every run, reference and resumed alike, computes with the same setting).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_paddle as cp  # noqa: E402
from _models import SeedCNN, snapshot  # noqa: E402

SEED, DATA_SEED, BS, EPOCHS = 1024, 4, 32, 3
N_CNN = 1000
N_FIT = 640
ACC = 4
# Kill points (counts of batches trained), inside epoch 1 (batches 32..63 with 1000 samples).
PLAIN_SAVE_EVERY, PLAIN_SIGNAL = 5, 40
ACCUM_SAVE_EVERY, ACCUM_SIGNAL = 10, 50      # 50 % 4 == 2: inside a window, after 2 of 4 micro-batches
FIT_SAVE_FREQ, FIT_SIGNAL = 5, 27
DP_N, DP_BS, DP_SAVE_EVERY = 96, 8, 3
DP_SIGNAL = {"first": 15, "second": 27}       # epoch 1 batch 3; epoch 2 batch 3 (12 batches an epoch)


class Synthetic(paddle.io.Dataset):
    """MNIST-shaped synthetic data: 1x28x28 float32 images in [0, 1) and int64 labels."""

    def __init__(self, n: int):
        rs = np.random.RandomState(2024)
        self.x = rs.rand(n, 1, 28, 28).astype("float32")
        self.y = rs.randint(0, 10, (n, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


def bits(value) -> int:
    return int(np.asarray(value, dtype=np.float32).reshape(()).view(np.uint32))


def seed_all() -> None:
    paddle.seed(SEED)
    np.random.seed(SEED)
    random.seed(SEED)


def build_cnn(n: int):
    seed_all()
    model = SeedCNN()
    total = -(-n // BS) * EPOCHS
    sch = paddle.optimizer.lr.PolynomialDecay(learning_rate=0.01, decay_steps=total, end_lr=0.001)
    opt = paddle.optimizer.Momentum(learning_rate=sch, parameters=model.parameters())
    return model, opt, sch


def global_batch(cursor) -> int:
    """Batches trained so far, from the cursor alone."""
    return cursor.epoch * cursor.batches_per_epoch + cursor.position // cursor.batch_size


def write(d: str, name: str, info: dict, arrays: dict) -> None:
    np.savez(os.path.join(d, f"{name}.npz"), **arrays)
    with open(os.path.join(d, f"{name}.json"), "w") as f:
        json.dump(info, f)


class Log:
    """One JSON line per batch, flushed, so a killed run leaves what it did."""

    def __init__(self, d: str, name: str):
        self.f = open(os.path.join(d, f"{name}.jsonl"), "a", buffering=1)

    def __call__(self, **row) -> None:
        self.f.write(json.dumps(row) + "\n")


def signal_kill(g: int) -> None:
    print(f"KILL {g}", flush=True)


def sleep_forever() -> None:
    while True:  # the parent's SIGKILL ends this
        time.sleep(1)


# ----------------------------------------------------------------------------- custom loop (1)


def custom_loop(d: str, name: str, root: str, *, acc: int, restore: str | None = None,
                save_every: int = 0, save_epochs: bool = False, signal_at: int | None = None,
                async_save: bool = False) -> None:
    """Seed 004's CNN trained by hand with a DataLoader that prefetches (buffer thread, num_workers=0).

    ``restore``: None (from scratch), ``"latest"`` or a step number.  With ``signal_at`` (a victim)
    saving stops at that batch (so the newest checkpoint is known) unless saves are async, and the run
    never finishes epoch 1.  Without accumulation the manager captures and restores through the
    keyword objects; with it, through ``ckptcore_paddle.capture``/``restore`` explicitly.
    """
    model, opt, sch = build_cnn(N_CNN)
    cursor = ckptcore.DataCursor(N_CNN, BS, seed=DATA_SEED)
    sampler = cp.ResumableBatchSampler(cursor)
    loader = paddle.io.DataLoader(Synthetic(N_CNN), batch_sampler=sampler)
    mgr = ckptcore.CheckpointManager(root, keep=None, async_save=async_save)
    info: dict = {}
    if restore is not None:
        step = None if restore == "latest" else int(restore)
        if acc == 1:
            state = mgr.restore(step, model=model, optimizer=opt, cursor=cursor)
        else:
            state = mgr.restore(step)
            assert cp.restore(state, model, opt, cursor=cursor).ok
        acc_state = state.accumulation
        info["restored"] = {"batch": global_batch(cursor), "epoch": cursor.epoch, "position": cursor.position,
                            "accumulation": None if acc_state is None else
                            [acc_state.every, acc_state.count, sorted(acc_state.buffers)]}
    log = Log(d, name) if signal_at is not None else None
    g = global_batch(cursor)
    losses: dict[str, int] = {}
    while cursor.epoch < EPOCHS:
        if signal_at is not None and cursor.epoch > 1:
            sleep_forever()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y).mean()
            (loss if acc == 1 else loss / acc).backward()
            losses[str(g)] = bits(loss.numpy())
            sampler.advance()  # trained: the cursor may move past this batch
            g += 1
            if g % acc == 0:
                opt.step()
                opt.clear_grad()
                sch.step()
            if log:
                log(batch=g - 1, loss=losses[str(g - 1)])
            due = (save_every and g % save_every == 0) or (save_epochs and cursor.position == 0)
            if due and (signal_at is None or g <= signal_at or async_save):
                if acc == 1:
                    mgr.save(g, model=model, optimizer=opt, cursor=cursor)
                else:  # views are enough: the save is synchronous
                    mgr.save(g, cp.capture(model, opt, cursor=cursor, accumulate_every=acc, accumulated=g % acc,
                                           copy=False))
            if g == signal_at:
                mgr.wait()
                signal_kill(g)
    mgr.close()
    info["losses"] = losses
    info["final_lr"] = sch.last_lr
    write(d, name, info, snapshot(model, opt))


# ----------------------------------------------------------------------------- hapi fit (2)


class Recorder(paddle.callbacks.Callback):
    """Per-batch losses by global batch index (after Checkpoint has advanced the cursor)."""

    def __init__(self, cursor, log=None, signal_at=None):
        super().__init__()
        self.cursor, self.log, self.signal_at = cursor, log, signal_at
        self.losses: dict[str, int] = {}

    def on_train_batch_end(self, step, logs=None):
        g = global_batch(self.cursor) - 1
        self.losses[str(g)] = bits(logs["loss"][0])
        if self.log:
            self.log(batch=g, loss=self.losses[str(g)])
        if g + 1 == self.signal_at:
            signal_kill(g + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.signal_at is not None and self.cursor.epoch > 1:
            sleep_forever()


def fit_run(d: str, name: str, root: str, *, victim: bool = False) -> None:
    seed_all()
    net = SeedCNN()
    total = -(-N_FIT // BS) * EPOCHS
    sch = paddle.optimizer.lr.PolynomialDecay(learning_rate=0.01, decay_steps=total, end_lr=0.001)
    opt = paddle.optimizer.Momentum(learning_rate=sch, parameters=net.parameters())
    model = paddle.Model(net)
    model.prepare(opt, paddle.nn.CrossEntropyLoss())
    cursor = ckptcore.DataCursor(N_FIT, BS, seed=DATA_SEED)
    sampler = cp.ResumableBatchSampler(cursor)
    loader = paddle.io.DataLoader(Synthetic(N_FIT), batch_sampler=sampler)
    ckpt = cp.Checkpoint(root, save_freq=FIT_SAVE_FREQ, cursor=sampler, keep=None)
    rec = Recorder(cursor, Log(d, name) if victim else None, FIT_SIGNAL if victim else None)
    model.fit(loader, epochs=EPOCHS, callbacks=[ckpt, rec], verbose=0)
    info = {"losses": rec.losses, "final_lr": sch.last_lr, "initial_epoch": ckpt.initial_epoch,
            "restored": None if ckpt.restored is None else
            {"batch": ckpt.restored.step, "data": ckpt.restored.data},
            "cursor": [cursor.epoch, cursor.position], "stop_training": model.stop_training}
    write(d, name, info, snapshot(net, opt))


# ----------------------------------------------------------------------------- data parallel (4)


class Mlp(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(16, 32)
        self.fc2 = paddle.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(paddle.tanh(self.fc1(x)))


def _dp_data():
    rs = np.random.RandomState(7)
    return rs.randn(DP_N, 16).astype("float32"), rs.randint(0, 10, (DP_N, 1)).astype("int64")


def dp_rank(d: str, phase: str) -> None:
    """One rank of the two-process job; ``first`` starts fresh, ``second`` resumes; both get killed."""
    import paddle.distributed as dist
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_all()
    net = Mlp()
    model = paddle.DataParallel(net)
    opt = paddle.optimizer.Adam(0.01, parameters=model.parameters())
    cursor = ckptcore.DataCursor(DP_N, DP_BS, seed=DATA_SEED)
    sampler = cp.ResumableBatchSampler(cursor, rank=rank, world_size=world)
    xs, ys = _dp_data()
    root = os.path.join(d, "dp_ckpt")
    mgr = ckptcore.CheckpointManager(root, keep=None)
    if phase == "second":
        mgr.restore(model=model, optimizer=opt, cursor=cursor)
    log = Log(d, f"dp_{phase}_rank{rank}")
    signal_at = DP_SIGNAL[phase]
    g = global_batch(cursor)
    while cursor.epoch < EPOCHS:
        if cursor.epoch > signal_at // 12:
            sleep_forever()
        for idx in sampler:
            loss = F.cross_entropy(model(paddle.to_tensor(xs[idx])), paddle.to_tensor(ys[idx])).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            sampler.advance()
            log(batch=g, loss=bits(loss.numpy()), samples=idx)
            g += 1
            if rank == 0 and g % DP_SAVE_EVERY == 0 and g <= signal_at:
                mgr.save(g, model=model, optimizer=opt, cursor=cursor)
                if g == signal_at:
                    np.savez(os.path.join(d, f"dp_{phase}_saved.npz"), **snapshot(net, opt))
                    signal_kill(g)
    sleep_forever()


def elastic(d: str) -> None:
    """The job resumed in one process, with the plain (unwrapped) model, to the end."""
    seed_all()
    net = Mlp()
    opt = paddle.optimizer.Adam(0.01, parameters=net.parameters())
    cursor = ckptcore.DataCursor(DP_N, DP_BS, seed=DATA_SEED)
    xs, ys = _dp_data()
    mgr = ckptcore.CheckpointManager(os.path.join(d, "dp_ckpt"), keep=None)
    state = mgr.restore(model=net, optimizer=opt, cursor=cursor)
    np.savez(os.path.join(d, "dp_elastic_restored.npz"), **snapshot(net, opt))
    rows = []
    g = global_batch(cursor)
    info = {"restored": {"batch": g, "step": state.step, "names": sorted(state.model)}}
    while cursor.epoch < EPOCHS:
        for idx in cursor.iter_epoch():  # no DataLoader: the cursor advances as batches are taken
            loss = F.cross_entropy(net(paddle.to_tensor(xs[idx])), paddle.to_tensor(ys[idx])).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            rows.append({"batch": g, "loss": float(loss), "samples": idx.tolist()})
            g += 1
    info["rows"] = rows
    write(d, "dp_elastic", info, snapshot(net, opt))


# ----------------------------------------------------------------------------- entry points


def reference(d: str) -> None:
    custom_loop(d, "ref_plain", os.path.join(d, "ckpt_ref_plain"), acc=1, save_epochs=True)
    custom_loop(d, "ref_accum", os.path.join(d, "ckpt_ref_accum"), acc=ACC)
    fit_run(d, "ref_fit", os.path.join(d, "ckpt_ref_fit"))


def victim(d: str, name: str) -> None:
    root = os.path.join(d, f"ckpt_kill_{name}")
    if name == "plain":
        custom_loop(d, "victim_plain", root, acc=1, save_every=PLAIN_SAVE_EVERY, signal_at=PLAIN_SIGNAL,
                    async_save=True)
    elif name == "accum":
        custom_loop(d, "victim_accum", root, acc=ACC, save_every=ACCUM_SAVE_EVERY, signal_at=ACCUM_SIGNAL)
    elif name == "fit":
        fit_run(d, "victim_fit", root, victim=True)
    raise SystemExit("the victim was not killed")


def resume(d: str) -> None:
    custom_loop(d, "resume_a", os.path.join(d, "ckpt_ref_plain"), acc=1, restore=str(-(-N_CNN // BS)))
    custom_loop(d, "resume_b", os.path.join(d, "ckpt_kill_plain"), acc=1, restore="latest",
                save_every=PLAIN_SAVE_EVERY)
    custom_loop(d, "resume_c", os.path.join(d, "ckpt_kill_accum"), acc=ACC, restore="latest")
    fit_run(d, "resume_fit", os.path.join(d, "ckpt_kill_fit"))


def dp_env(rank: int, ports: list[int]) -> dict[str, str]:
    """What ``paddle.distributed.launch``/``spawn`` give each gloo rank."""
    eps = [f"127.0.0.1:{p}" for p in ports]
    return {"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(len(ports)),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(eps), "PADDLE_CURRENT_ENDPOINT": eps[rank],
            "PADDLE_DISTRI_BACKEND": "gloo"}


if __name__ == "__main__":
    command, directory, *rest = sys.argv[1:]
    if command == "dp":
        os.environ.update(dp_env(int(rest[1]), [int(p) for p in rest[2].split(",")]))
    {"reference": lambda: reference(directory),
     "victim": lambda: victim(directory, rest[0]),
     "resume": lambda: resume(directory),
     "dp": lambda: dp_rank(directory, rest[0]),
     "elastic": lambda: elastic(directory)}[command]()
