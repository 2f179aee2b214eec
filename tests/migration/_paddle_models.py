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


# ----------------------------------------------------------------------------- structure twins
# The Keras twins of ``_keras_models`` in Paddle, channels-first, padding "SAME" (TensorFlow's
# asymmetric padding for stride 2), BatchNorms with Keras' momentum and epsilon.  Layers are defined
# in an order different from the Keras layer list (shortcuts and decoders first) on purpose.


def _bn(c):
    return nn.BatchNorm2D(c, momentum=0.99, epsilon=1e-3)


def _conv(cin, cout, k, stride=1, groups=1, bias=False):
    return nn.Conv2D(cin, cout, k, stride=stride, padding="SAME", groups=groups,
                     bias_attr=None if bias else False)


class ResNetTwin(nn.Layer):
    def __init__(self):
        super().__init__()
        self.short_conv, self.short_bn = _conv(8, 16, 1, 2), _bn(16)     # the shortcut, defined first
        self.b2_conv2, self.b2_bn2 = _conv(16, 16, 3), _bn(16)
        self.b2_conv1, self.b2_bn1 = _conv(8, 16, 3, 2), _bn(16)
        self.stem, self.stem_bn = _conv(3, 8, 3), _bn(8)
        self.b1_conv1, self.b1_bn1 = _conv(8, 8, 3), _bn(8)
        self.b1_conv2, self.b1_bn2 = _conv(8, 8, 3), _bn(8)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        y = self.b1_bn2(self.b1_conv2(F.relu(self.b1_bn1(self.b1_conv1(x)))))
        x = F.relu(x + y)
        s = self.short_bn(self.short_conv(x))
        y = self.b2_bn2(self.b2_conv2(F.relu(self.b2_bn1(self.b2_conv1(x)))))
        x = F.relu(y + s)
        return self.fc(x.mean(axis=[2, 3]))


class UNetTwin(nn.Layer):
    def __init__(self):
        super().__init__()
        self.up1, self.dec1, self.dec1_bn = nn.Conv2DTranspose(16, 8, 2, stride=2), _conv(16, 8, 3), _bn(8)
        self.up2, self.dec2, self.dec2_bn = nn.Conv2DTranspose(16, 16, 2, stride=2), _conv(32, 16, 3), _bn(16)
        self.enc1, self.enc1_bn = _conv(3, 8, 3), _bn(8)
        self.enc2, self.enc2_bn = _conv(8, 16, 3), _bn(16)
        self.mid, self.mid_bn = _conv(16, 16, 3), _bn(16)
        self.head = nn.Conv2D(8, 10, 1)

    def forward(self, x):
        e1 = F.relu(self.enc1_bn(self.enc1(x)))
        e2 = F.relu(self.enc2_bn(self.enc2(F.max_pool2d(e1, 2))))
        b = F.relu(self.mid_bn(self.mid(F.max_pool2d(e2, 2))))
        d2 = F.relu(self.dec2_bn(self.dec2(paddle.concat([self.up2(b), e2], axis=1))))
        d1 = F.relu(self.dec1_bn(self.dec1(paddle.concat([self.up1(d2), e1], axis=1))))
        return self.head(d1).mean(axis=[2, 3])


class Inverted(nn.Layer):
    def __init__(self, cin, cout, expand, stride):
        super().__init__()
        mid = cin * expand
        self.residual = stride == 1 and cin == cout
        self.project, self.project_bn = _conv(mid, cout, 1), _bn(cout)    # defined before the rest
        self.dw, self.dw_bn = _conv(mid, mid, 3, stride, groups=mid), _bn(mid)
        self.expand = (_conv(cin, mid, 1), _bn(mid)) if expand != 1 else None
        if self.expand:
            self.expand_conv, self.expand_bn = self.expand

    def forward(self, x):
        y = x
        if self.expand:
            y = F.relu6(self.expand_bn(self.expand_conv(y)))
        y = F.relu6(self.dw_bn(self.dw(y)))
        y = self.project_bn(self.project(y))
        return x + y if self.residual else y


class MobileNetTwin(nn.Layer):
    def __init__(self):
        super().__init__()
        self.head, self.head_bn = _conv(12, 32, 1), _bn(32)
        self.fc = nn.Linear(32, 10)
        self.stem, self.stem_bn = _conv(3, 8, 3, 2), _bn(8)
        self.blocks = nn.LayerList([Inverted(8, 8, 1, 1), Inverted(8, 12, 3, 2), Inverted(12, 12, 3, 1),
                                    Inverted(12, 12, 3, 1)])

    def forward(self, x):
        x = F.relu6(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        x = F.relu6(self.head_bn(self.head(x)))
        return self.fc(x.mean(axis=[2, 3]))


class BranchesTwin(nn.Layer):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2D(3, 8, 3, padding="SAME")
        self.a = nn.Conv2D(8, 8, 3, padding="SAME")
        self.b = nn.Conv2D(8, 8, 3, padding="SAME")
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.stem(x)
        return self.fc((self.a(x) + self.b(x)).mean(axis=[2, 3]))


_TWINS = {"resnet": ResNetTwin, "unet": UNetTwin, "mobilenet": MobileNetTwin, "branches": BranchesTwin}


def twin(name: str, seed: int = 0) -> nn.Layer:
    """The twin with Keras' Glorot-uniform kernels (Paddle's default convolution init gives logits
    ~40x larger, and with them float32 noise ~40x larger than the Keras runs')."""
    paddle.seed(seed)
    net = _TWINS[name]()
    rs = np.random.RandomState(seed)
    for p in net.parameters():
        shape = list(p.shape)
        if len(shape) < 2:
            continue
        if len(shape) == 2:   # Linear: [in, out]
            fan_in, fan_out = shape
        else:                 # convolutions: [out, in/groups, *k] (transposed: [in, out/groups, *k])
            k = int(np.prod(shape[2:]))
            fan_in, fan_out = shape[1] * k, shape[0] * k
        lim = np.sqrt(6.0 / (fan_in + fan_out))
        p.set_value(rs.uniform(-lim, lim, size=shape).astype("float32"))
    return net


# ----------------------------------------------------------------------------- PyTorch pairs


class TransformerTwin(nn.Layer):
    """The torch/Keras Transformer encoder block with ``paddle.nn.MultiHeadAttention`` (separate
    q_proj/k_proj/v_proj/out_proj Linear layers)."""

    def __init__(self):
        super().__init__()
        from _common import SEQ_EMBED, SEQ_FEAT, SEQ_HEADS, TWIN_CLASSES
        e = SEQ_EMBED
        self.embed = nn.Linear(SEQ_FEAT, e)
        self.attn = nn.MultiHeadAttention(e, SEQ_HEADS)
        self.ln1, self.ln2 = nn.LayerNorm(e, epsilon=1e-5), nn.LayerNorm(e, epsilon=1e-5)
        self.ff1, self.ff2 = nn.Linear(e, 2 * e), nn.Linear(2 * e, e)
        self.head = nn.Linear(e, TWIN_CLASSES)

    def forward(self, x):
        x = self.embed(x)
        x = self.ln1(x + self.attn(x, x, x))
        x = self.ln2(x + self.ff2(F.relu(self.ff1(x))))
        return self.head(x.mean(axis=1))


_TWINS["transformer"] = TransformerTwin


def logits(net, x: np.ndarray, *, training: bool = False) -> np.ndarray:
    """Eval-mode logits, or training-mode ones (batch statistics; moving statistics put back)."""
    saved = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    net.train() if training else net.eval()
    out = net(paddle.to_tensor(x)).numpy()
    if training:
        net.set_state_dict({k: paddle.to_tensor(v) for k, v in saved.items()})
    net.train()
    return out
