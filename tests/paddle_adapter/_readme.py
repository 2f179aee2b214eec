"""Runs the Paddle code block of README.md as written, in the current folder:
``python _readme.py <README.md> <work folder>``.  Only the names the README leaves to the reader are defined
first (a dataset, a network, its optimizer and scheduler, a prepared ``paddle.Model``)."""

from __future__ import annotations

import json
import os
import re
import sys
import warnings

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import paddle  # noqa: E402


class TrainDS(paddle.io.Dataset):
    def __init__(self):
        rs = np.random.RandomState(0)
        self.x, self.y = rs.randn(70, 5).astype("float32"), rs.randint(0, 3, (70, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return 70


def main(readme: str) -> None:
    text = open(readme).read()
    section = text[text.index("\n## Paddle\n"):]
    section = section[:section.index("\n## ", 1)]
    # The section's training block (the one with the DataLoader); its other blocks run in
    # tests/test_readme.py.
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S)
              if "ckptcore_paddle.DataLoader(" in b]
    assert len(blocks) == 1, len(blocks)
    paddle.seed(0)
    net = paddle.nn.Linear(5, 3)
    sched = paddle.optimizer.lr.StepDecay(0.1, step_size=3)
    opt = paddle.optimizer.Adam(learning_rate=sched, parameters=net.parameters())
    model = paddle.Model(net)
    model.prepare(opt, paddle.nn.CrossEntropyLoss())
    ns = {"paddle": paddle, "train_ds": TrainDS(), "net": net, "opt": opt, "sched": sched, "model": model,
          "loss_fn": paddle.nn.functional.cross_entropy, "E": 2, "EPOCHS": 3}
    exec(compile(blocks[0], "README.md (Paddle)", "exec"), ns)
    print(json.dumps({"epoch": ns["cursor"].epoch, "step": ns["step"], "steps": ns["mgr"].steps()}))


if __name__ == "__main__":
    readme = os.path.abspath(sys.argv[1])
    os.chdir(sys.argv[2])  # the README's roots are relative
    main(readme)
