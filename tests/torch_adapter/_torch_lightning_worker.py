"""A tiny deterministic Lightning fit with ckptcore_torch.Checkpoint, run in-process by
test_torch_lightning.py and as a real process (``python _torch_lightning_worker.py SPEC.json``)
that the test SIGKILLs or SIGTERMs.

Every trained batch appends one JSON line to ``log`` (epoch, batch_idx, global_step, the sample
ids, the learning rate, a dropout draw) as it ends, so a killed run's log survives it.  The run's
end writes ``out``: Lightning's counters and what the callback restored.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

import torch

import ckptcore
import ckptcore_torch
import lightning.pytorch as L

N, BS = 36, 8  # 5 batches an epoch, the last of 4

warnings.filterwarnings("ignore")  # Lightning's tips about workers, logging intervals...


class Net(L.LightningModule):
    def __init__(self, log: str | None = None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(8, 3))
        self.log_path = log

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        if self.log_path:
            record = {"epoch": self.current_epoch, "batch_idx": batch_idx, "global_step": self.global_step,
                      "ids": ids.tolist(), "lr": self.optimizers().param_groups[0]["lr"],
                      "loss": float(loss.detach()), "draw": float(torch.rand(()))}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g),
                                          torch.arange(N))


def loader(cursor: ckptcore.DataCursor) -> torch.utils.data.DataLoader:
    # The cursor's own loader: it moves the cursor as each batch reaches Lightning's loop, and
    # its len() is the whole epoch while a resumed pass yields the rest.
    return ckptcore_torch.DataLoader(dataset(), cursor)


class Signal(L.Callback):
    """Sends this process ``sig`` as its ``at``-th batch (counted in this process) starts."""

    def __init__(self, sig: int, at: int):
        self.sig, self.at, self.seen = sig, at, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), self.sig)


def fit(root: str, *, log: str | None = None, signal_at: tuple[int, int] | None = None,
        **options) -> tuple[L.Trainer, Net, ckptcore_torch.Checkpoint]:
    """One ``trainer.fit``: ``options`` are the Trainer's ``max_epochs``/``max_steps`` and the
    callback's keywords."""
    torch.manual_seed(0)
    if log:
        os.makedirs(os.path.dirname(log), exist_ok=True)
    limits = {k: options.pop(k) for k in ("max_epochs", "max_steps") if k in options}
    cursor = ckptcore.DataCursor(N, BS, seed=3)
    ckpt = ckptcore_torch.Checkpoint(root, cursor=cursor, keep=None, **options)
    callbacks = [ckpt] if signal_at is None else [Signal(*signal_at), ckpt]
    trainer = L.Trainer(accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, deterministic=True, enable_model_summary=False,
                        callbacks=callbacks, **limits)
    model = Net(log)
    trainer.fit(model, loader(cursor))
    return trainer, model, ckpt


def counters(trainer: L.Trainer) -> dict:
    loop = trainer.fit_loop
    return {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch,
            "total_batches": loop.epoch_loop.batch_progress.total.completed,
            "batches_that_stepped": loop.epoch_loop._batches_that_stepped}


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    sig = spec.pop("signal", None)
    at = None if sig is None else (getattr(signal, sig), spec.pop("at"))
    out = spec.pop("out")
    trainer, _, ckpt = fit(spec.pop("root"), signal_at=at, **spec)
    restored = None if ckpt.restored is None else ckpt.restored.step
    with open(out, "w") as f:
        json.dump({**counters(trainer), "restored": restored, "preempted": ckpt.preempted}, f)


if __name__ == "__main__":
    main(sys.argv[1])
