"""PyTorch models, optimizers and training steps of the migration tests (imports torch only).

The twins of ``_keras_models``/``_paddle_models`` in torch: channels-first, TensorFlow's "same"
padding (asymmetric for stride 2) done by :class:`SameConv2d`, BatchNorms with Keras' statistics
(torch momentum 0.01 = Keras 0.99, eps 1e-3), Glorot-uniform kernels and zero biases as Keras
initialises them.  Layers are defined in another order than they run, as in the Paddle twins.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ckptcore_torch.keras_adam import KerasAdam, KerasAdamW
from _common import SEQ_EMBED, SEQ_FEAT, SEQ_HEADS, TWIN_CLASSES

torch.set_num_threads(1)


class SameConv2d(nn.Conv2d):
    """``nn.Conv2d`` with TensorFlow's ``padding="same"``: the extra row/column goes bottom/right."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for size, k, s, d in zip(x.shape[-2:], self.kernel_size, self.stride, self.dilation):
            total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
            pads.append((total // 2, total - total // 2))
        (pt, pb), (pl, pr) = pads
        return self._conv_forward(F.pad(x, (pl, pr, pt, pb)), self.weight, self.bias)


def _conv(cin, cout, k, stride=1, groups=1, bias=False):
    return SameConv2d(cin, cout, k, stride=stride, padding=0, groups=groups, bias=bias)


def _bn(c):
    return nn.BatchNorm2d(c, momentum=0.01, eps=1e-3)


class ResNetTwin(nn.Module):
    def __init__(self):
        super().__init__()
        self.short_conv, self.short_bn = _conv(8, 16, 1, 2), _bn(16)
        self.b2_conv2, self.b2_bn2 = _conv(16, 16, 3), _bn(16)
        self.b2_conv1, self.b2_bn1 = _conv(8, 16, 3, 2), _bn(16)
        self.stem, self.stem_bn = _conv(3, 8, 3), _bn(8)
        self.b1_conv1, self.b1_bn1 = _conv(8, 8, 3), _bn(8)
        self.b1_conv2, self.b1_bn2 = _conv(8, 8, 3), _bn(8)
        self.fc = nn.Linear(16, TWIN_CLASSES)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        y = self.b1_bn2(self.b1_conv2(F.relu(self.b1_bn1(self.b1_conv1(x)))))
        x = F.relu(x + y)
        s = self.short_bn(self.short_conv(x))
        y = self.b2_bn2(self.b2_conv2(F.relu(self.b2_bn1(self.b2_conv1(x)))))
        return self.fc(F.relu(y + s).mean(dim=(2, 3)))


class UNetTwin(nn.Module):
    def __init__(self):
        super().__init__()
        self.up1, self.dec1, self.dec1_bn = nn.ConvTranspose2d(16, 8, 2, stride=2), _conv(16, 8, 3), _bn(8)
        self.up2, self.dec2, self.dec2_bn = nn.ConvTranspose2d(16, 16, 2, stride=2), _conv(32, 16, 3), _bn(16)
        self.enc1, self.enc1_bn = _conv(3, 8, 3), _bn(8)
        self.enc2, self.enc2_bn = _conv(8, 16, 3), _bn(16)
        self.mid, self.mid_bn = _conv(16, 16, 3), _bn(16)
        self.head = nn.Conv2d(8, TWIN_CLASSES, 1)

    def forward(self, x):
        e1 = F.relu(self.enc1_bn(self.enc1(x)))
        e2 = F.relu(self.enc2_bn(self.enc2(F.max_pool2d(e1, 2))))
        b = F.relu(self.mid_bn(self.mid(F.max_pool2d(e2, 2))))
        d2 = F.relu(self.dec2_bn(self.dec2(torch.cat([self.up2(b), e2], dim=1))))
        d1 = F.relu(self.dec1_bn(self.dec1(torch.cat([self.up1(d2), e1], dim=1))))
        return self.head(d1).mean(dim=(2, 3))


class Inverted(nn.Module):
    def __init__(self, cin, cout, expand, stride):
        super().__init__()
        mid = cin * expand
        self.residual = stride == 1 and cin == cout
        self.project, self.project_bn = _conv(mid, cout, 1), _bn(cout)
        self.dw, self.dw_bn = _conv(mid, mid, 3, stride, groups=mid), _bn(mid)
        self.has_expand = expand != 1
        if self.has_expand:
            self.expand_conv, self.expand_bn = _conv(cin, mid, 1), _bn(mid)

    def forward(self, x):
        y = x
        if self.has_expand:
            y = F.relu6(self.expand_bn(self.expand_conv(y)))
        y = F.relu6(self.dw_bn(self.dw(y)))
        y = self.project_bn(self.project(y))
        return x + y if self.residual else y


class MobileNetTwin(nn.Module):
    def __init__(self):
        super().__init__()
        self.head, self.head_bn = _conv(12, 32, 1), _bn(32)
        self.fc = nn.Linear(32, TWIN_CLASSES)
        self.stem, self.stem_bn = _conv(3, 8, 3, 2), _bn(8)
        self.blocks = nn.ModuleList([Inverted(8, 8, 1, 1), Inverted(8, 12, 3, 2), Inverted(12, 12, 3, 1),
                                     Inverted(12, 12, 3, 1)])

    def forward(self, x):
        x = F.relu6(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.fc(F.relu6(self.head_bn(self.head(x))).mean(dim=(2, 3)))


class TransformerTwin(nn.Module):
    """A post-norm Transformer encoder block on [batch, seq, feature]: Linear embedding, self-attention
    (packed in_proj), Add & LayerNorm, feed-forward, Add & LayerNorm, mean over the sequence, head."""

    def __init__(self):
        super().__init__()
        e = SEQ_EMBED
        self.head = nn.Linear(e, TWIN_CLASSES)
        self.ln2, self.ln1 = nn.LayerNorm(e, eps=1e-5), nn.LayerNorm(e, eps=1e-5)
        self.ff2, self.ff1 = nn.Linear(2 * e, e), nn.Linear(e, 2 * e)
        self.attn = nn.MultiheadAttention(e, SEQ_HEADS, batch_first=True)
        self.embed = nn.Linear(SEQ_FEAT, e)

    def forward(self, x):
        x = self.embed(x)
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.ln1(x + a)
        x = self.ln2(x + self.ff2(F.relu(self.ff1(x))))
        return self.head(x.mean(dim=1))


class BranchesTwin(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = _conv(3, 8, 3, bias=True)
        self.a = _conv(8, 8, 3, bias=True)
        self.b = _conv(8, 8, 3, bias=True)
        self.fc = nn.Linear(8, TWIN_CLASSES)

    def forward(self, x):
        x = self.stem(x)
        return self.fc((self.a(x) + self.b(x)).mean(dim=(2, 3)))


_TWINS = {"resnet": ResNetTwin, "unet": UNetTwin, "mobilenet": MobileNetTwin, "transformer": TransformerTwin,
          "branches": BranchesTwin}


def twin(name: str, seed: int = 0) -> nn.Module:
    """The twin with Glorot-uniform kernels and zero biases (Keras' initialisation)."""
    torch.manual_seed(seed)
    net = _TWINS[name]()
    rs = np.random.RandomState(seed)
    with torch.no_grad():
        for pname, p in net.named_parameters():
            shape = list(p.shape)
            if len(shape) < 2:
                if not pname.endswith("weight"):   # biases zero; norm gammas stay one
                    p.zero_()
                continue
            k = int(np.prod(shape[2:])) if len(shape) > 2 else 1
            if pname.endswith("in_proj_weight"):   # three [e, e] projections stacked
                fan_in = fan_out = shape[1]
            elif isinstance(dict(net.named_modules()).get(pname.rpartition(".")[0]), nn.ConvTranspose2d):
                fan_in, fan_out = shape[1] * k, shape[0] * k
            else:
                fan_in, fan_out = shape[1] * k, shape[0] * k
            lim = np.sqrt(6.0 / (fan_in + fan_out))
            p.copy_(torch.from_numpy(rs.uniform(-lim, lim, size=shape).astype("float32")))
    return net


_OPTS = {"KerasAdam": KerasAdam, "KerasAdamW": KerasAdamW}


def optimizer(name: str, kwargs: dict, params):
    return (_OPTS.get(name) or getattr(torch.optim, name))(params, **kwargs)


def train_step(net, opt, x: np.ndarray, y: np.ndarray) -> float:
    net.train()
    loss = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)   # no gradients in flight at a checkpoint
    return float(loss.detach())


def logits(net, x: np.ndarray, *, training: bool = False) -> np.ndarray:
    """Eval-mode logits, or training-mode ones (batch statistics; running statistics untouched)."""
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    net.train(training)
    with torch.no_grad():
        out = net(torch.from_numpy(x)).numpy()
    if training:
        net.load_state_dict(saved)
    net.train()
    return out


def cli_transformer():
    """``ckpt convert --model _torch_models:cli_transformer``: a torch target for a Keras checkpoint."""
    net = twin("transformer", 99)
    return net, KerasAdamW(net.parameters(), lr=1e-3, weight_decay=0.05)
