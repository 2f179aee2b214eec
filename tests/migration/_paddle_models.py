"""Paddle models, optimizers and training steps of the migration tests (imports Paddle)."""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", module="paddle")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
from paddle import nn  # noqa: E402
from paddle.optimizer import lr as L  # noqa: E402

from ckptcore_paddle.keras_adam import KerasAdam, KerasAdamW  # noqa: E402

paddle.set_device("cpu")


class MNIST(nn.Layer):
    """Seed 004's network, verbatim in structure: conv, pool, conv, pool, reshape to 980, linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2D(in_channels=1, out_channels=20, kernel_size=5, stride=1, padding=2)
        self.max_pool1 = nn.MaxPool2D(kernel_size=2, stride=2)
        self.conv2 = nn.Conv2D(in_channels=20, out_channels=20, kernel_size=5, stride=1, padding=2)
        self.max_pool2 = nn.MaxPool2D(kernel_size=2, stride=2)
        self.fc = nn.Linear(in_features=980, out_features=10)

    def forward(self, inputs):
        x = self.max_pool1(F.relu(self.conv1(inputs)))
        x = self.max_pool2(F.relu(self.conv2(x)))
        x = paddle.reshape(x, [x.shape[0], 980])
        return self.fc(x)


def cnn(seed: int = 0) -> MNIST:
    paddle.seed(seed)
    return MNIST()


_OPTS = {"KerasAdam": KerasAdam, "KerasAdamW": KerasAdamW}


def optimizer(name: str, kwargs: dict, params, scheduler=None):
    kw = dict(kwargs)
    if scheduler is not None:
        kw["learning_rate"] = scheduler
    cls = _OPTS.get(name) or getattr(paddle.optimizer, name)
    return cls(parameters=params, **kw)


def scheduler(name: str, kwargs: dict):
    kw = dict(kwargs)
    if isinstance(kw.get("learning_rate"), (tuple, list)):
        kw["learning_rate"] = scheduler(*kw["learning_rate"])
    return getattr(L, name)(**kw)


def train_step(net, opt, x: np.ndarray, y: np.ndarray, sch=None) -> float:
    loss = F.cross_entropy(net(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    if sch is not None:
        sch.step()
    return float(loss)


def tiny() -> nn.Layer:
    paddle.seed(1)
    return nn.Sequential(nn.Linear(4, 2))


def tiny_step(net, opt, sch, x: np.ndarray) -> None:
    net(paddle.to_tensor(x)).square().mean().backward()
    opt.step()
    opt.clear_grad()
    sch.step()


class Zoo(nn.Layer):
    """The Keras zoo model of ``_keras_models.zoo`` in Paddle (channels-first convolutions).

    Keras lists a functional model's layers by graph depth (the two branches interleaved), Paddle
    by definition: migration pairs the branches anyway.
    """

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv1d = nn.Conv1D(4, 6, 3)
        self.lstm = nn.LSTM(6, 5)
        self.gru = nn.GRU(5, 3)
        self.ln = nn.LayerNorm(3, epsilon=1e-3)
        self.dw = nn.Conv2D(3, 6, 3, groups=3)
        self.convt = nn.Conv2DTranspose(6, 2, 3)
        self.bn = nn.BatchNorm2D(2, momentum=0.99, epsilon=1e-3)
        self.fc = nn.Linear(72, 3)

    def forward(self, seq, img):
        x = self.conv1d(self.emb(seq).transpose([0, 2, 1])).transpose([0, 2, 1])
        x, _ = self.lstm(x)
        x, _ = self.gru(x)
        x = self.ln(x[:, -1])
        y = self.bn(self.convt(self.dw(img)))
        return x, self.fc(paddle.reshape(y, [y.shape[0], -1]))


def zoo(seed: int = 3) -> Zoo:
    paddle.seed(seed)
    model = Zoo()
    rs = np.random.RandomState(seed)
    for name, t in model.state_dict().items():
        val = rs.randn(*t.shape).astype("float32") * 0.5
        if name.endswith("_variance"):
            val = np.abs(val) + 0.5
        t.set_value(val)
    model.eval()
    return model


def zoo_inputs() -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(11)
    seq, img = rs.randint(0, 10, size=(16, 5)).astype("int32"), rs.randn(16, 6, 6, 3).astype("float32")
    return seq.astype("int64"), np.ascontiguousarray(img.transpose(0, 3, 1, 2))


def zoo_outputs(model) -> list[np.ndarray]:
    model.eval()
    seq, img = zoo_inputs()
    return [o.numpy() for o in model(paddle.to_tensor(seq), paddle.to_tensor(img))]


def cli_cnn_adam():
    """``ckpt convert --model _paddle_models:cli_cnn_adam``: the target of the Paddle leg.

    Built under a fresh name scope, so every call gives the same runtime names (``.pdopt`` keys).
    """
    with paddle.utils.unique_name.guard():
        net = cnn(6)
        return net, KerasAdam(1e-3, parameters=net.parameters())
