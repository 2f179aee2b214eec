"""The PyTorch models of bench_models_torch.py, defined here (torchvision is not installed).

* ``resnet50``: torchvision's ResNet-50 v1.5 layout (Bottleneck blocks 3-4-6-3, stride on the
  3x3 convolution, BatchNorm after every convolution, 1000 classes): 25.6M parameters in 161
  tensors, plus 159 BatchNorm buffers (running mean, variance, batch count) = 320 state_dict
  entries, most of them small: the per-tensor cost decides this one.
* ``gpt2``: a GPT-2-small-sized decoder (12 layers, d=768, 12 heads, vocab 50257, context 1024,
  pre-LayerNorm, GELU MLP of 4d, the LM head tied to the token embedding): 124.4M parameters in
  148 tensors, 0.5 GB of float32; with AdamW's two moments 1.5 GB: the bytes decide this one.
  The tied head appears twice in ``state_dict()`` (``lm_head.weight`` and ``wte.weight``, one
  tensor), as in Hugging Face's GPT-2.

``build(name, seed, quick=False)`` returns the model and an AdamW that has taken one step on a
small random batch, so every slot (``step``, ``exp_avg``, ``exp_avg_sq``) exists; ``quick``
shrinks both models (narrow ResNet, 2-layer GPT of d=128) for a smoke run.  Also the
benchmark's checks (``same``, ``perturb``), its ckptcore fallback path (``as_state``,
``put_back``: a TrainingState of NumPy views, restored by ``copy_``) and its raw floor
(``raw_save``, ``raw_load``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import ckptcore

MODELS = ("resnet50", "gpt2")


# ------------------------------------------------------------------------------------ ResNet-50
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.downsample = None
        if stride != 1 or inplanes != planes * self.expansion:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes * self.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * self.expansion))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._layer(width, layers[0], 1)
        self.layer2 = self._layer(width * 2, layers[1], 2)
        self.layer3 = self._layer(width * 4, layers[2], 2)
        self.layer4 = self._layer(width * 8, layers[3], 2)
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        mods = [Bottleneck(self.inplanes, planes, stride)]
        self.inplanes = planes * Bottleneck.expansion
        mods += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ---------------------------------------------------------------------------------------- GPT-2
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257,
                 context: int = 1024):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---------------------------------------------------------------------------------------- build
def make(name: str, quick: bool = False) -> nn.Module:
    if name == "resnet50":
        return ResNet((1, 1, 1, 1), width=16, num_classes=100) if quick else ResNet()
    if name == "gpt2":
        return GPT(layers=2, d=128, heads=4, vocab=1000, context=128) if quick else GPT()
    raise ValueError(f"unknown model {name!r} (known: {', '.join(MODELS)})")


def train_step(name: str, model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on a tiny random batch: every slot exists (and changes) afterwards."""
    g = torch.Generator().manual_seed(seed)
    model.train()
    if name == "resnet50":
        x = torch.randn(2, 3, 64, 64, generator=g)
        loss = model(x).logsumexp(1).mean()
    else:
        vocab = model.wte.num_embeddings
        idx = torch.randint(0, vocab, (1, 16), generator=g)
        loss = F.cross_entropy(model(idx)[0, :-1], idx[0, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def build(name: str, seed: int, quick: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``name`` (seeded) with AdamW after one step."""
    torch.manual_seed(seed)
    model = make(name, quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    train_step(name, model, opt, seed)
    return model, opt


@torch.no_grad()
def perturb(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Change every saved value in place (cheaper than a training step of GPT-2 on 2 cores), so
    the next restore has every value to put back."""
    for t in list(model.state_dict().values()):
        t.add_(1)
    for st in opt.state.values():
        for t in st.values():
            if torch.is_tensor(t):
                t.add_(1)


def flat(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and of the optimizer's state, by a stable name (for checks)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): k for k, p in model.named_parameters()}
    for p, st in opt.state.items():
        for s, v in st.items():
            if torch.is_tensor(v):
                out[f"opt.{names[id(p)]}.{s}"] = v
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a: tuple, b: tuple) -> str | None:
    """None when the two (model, optimizer) pairs hold bitwise the same state, else the first
    differing name."""
    fa, fb = flat(*a), flat(*b)
    if fa.keys() != fb.keys():
        return f"names differ: {sorted(fa.keys() ^ fb.keys())[:3]}"
    for k, x in fa.items():
        y = fb[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
            return k
    # hyperparameters of every group (the 1-step lr etc. must come back too)
    ga = [{k: v for k, v in g.items() if k != "params"} for g in a[1].param_groups]
    gb = [{k: v for k, v in g.items() if k != "params"} for g in b[1].param_groups]
    return None if ga == gb else "param_groups"


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of distinct tensors (the tied head counted once)."""
    return sum(t.numel() * t.element_size() for t in distinct(model, opt))


def distinct(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The distinct tensors of :func:`flat`, in its order (the tied head once): what a raw
    one-file save writes and a raw load reads back into."""
    seen, out = set(), []
    for t in flat(model, opt).values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


# ------------------------------------------------- bench_models_torch.py: the fallback ckptcore path
def as_state(model, opt) -> ckptcore.TrainingState:
    """A TrainingState of NumPy views of the live tensors (no copy), laid out as the adapter's
    (model keys = state_dict keys, a tied tensor once with an alias, slots by parameter key)."""
    model_arrays, aliases, seen = {}, {}, {}
    for k, t in model.state_dict(keep_vars=False).items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ident in seen:
            aliases[k] = seen[ident]
            continue
        seen[ident] = k
        model_arrays[k] = t.numpy()
    names = {id(p): k for k, p in model.named_parameters()}  # first name of a tied parameter
    slots = {names[id(p)]: {s: v.numpy() for s, v in st.items() if torch.is_tensor(v)}
             for p, st in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    step = max((int(st["step"]) for st in opt.state.values() if "step" in st), default=0)
    return ckptcore.TrainingState(
        model=model_arrays, framework="torch", step=step,
        optimizer=ckptcore.OptimizerState(kind=type(opt).__name__.lower(), step=step,
                                          hyperparams=dict(groups[0]), slots=slots,
                                          extra={"param_groups": groups}),
        extra={"torch": {"aliases": aliases}})


@torch.no_grad()
def put_back(state: ckptcore.TrainingState, model, opt) -> None:
    """Copy a loaded fallback state into the live tensors (``copy_``: no new tensors)."""
    aliases = state.extra["torch"]["aliases"]
    for k, t in model.state_dict().items():
        t.copy_(torch.from_numpy(state.model[aliases.get(k, k)]))
    names = {id(p): k for k, p in model.named_parameters()}
    for p, st in opt.state.items():
        for s, arr in state.optimizer.slots[names[id(p)]].items():
            st[s].copy_(torch.from_numpy(arr))
    for g, saved in zip(opt.param_groups, state.optimizer.extra["param_groups"]):
        g.update(saved)


# ------------------------------------------------------------- bench_models_torch.py: the raw floor
def raw_save(path: str, tensors: list[torch.Tensor]) -> None:
    """The floor of a save: every distinct tensor's bytes written into one file with ``writev``
    (no copy, no format, no checksum), then ``fsync``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        views = [memoryview(t.numpy()).cast("B") for t in tensors]
        for i in range(0, len(views), 512):  # IOV_MAX is 1024
            batch, want = views[i:i + 512], sum(v.nbytes for v in views[i:i + 512])
            done = os.writev(fd, batch)
            if done != want:  # a short write (rare on a local disk): finish one by one
                _finish(fd, batch, done)
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(fd: int, views: list, done: int) -> None:
    for v in views:
        if done >= v.nbytes:
            done -= v.nbytes
            continue
        rest = v[done:]
        while rest.nbytes:
            rest = rest[os.write(fd, rest):]
        done = 0


def raw_load(path: str, tensors: list[torch.Tensor]) -> None:
    """The floor of a restore into live objects: one sequential read of that file straight into
    the live tensors' memory (no allocation, no checksum, no format)."""
    with open(path, "rb", buffering=0) as f:
        for t in tensors:
            view = memoryview(t.numpy()).cast("B")
            while view.nbytes:
                got = f.readinto(view)
                if not got:
                    raise EOFError(f"{path} is shorter than the state")
                view = view[got:]
