"""Framework-free pieces shared by the Keras and Paddle workers: data, case lists, results files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

STEPS = 5                       # steps before the migration, and after it
BATCH = 8
IMG = 28                        # the MNIST CNN of the docs: 28x28x1 -> conv 20 5x5 -> pool -> conv 20 -> pool -> 980 -> 10

# Optimizer cases: (Keras constructor, Paddle constructor), both as (name, kwargs) pairs the
# workers build; "exact" says whether the continued runs must agree to 1e-5.
OPT_CASES: dict[str, dict[str, Any]] = {
    "adam": {"keras": ("Adam", {"learning_rate": 1e-3}),
             "paddle": ("KerasAdam", {"learning_rate": 1e-3}), "exact": True},
    "adamw": {"keras": ("AdamW", {"learning_rate": 1e-3, "weight_decay": 0.05}),
              "paddle": ("KerasAdamW", {"learning_rate": 1e-3, "weight_decay": 0.05}), "exact": True},
    "sgd_momentum": {"keras": ("SGD", {"learning_rate": 0.01, "momentum": 0.9}),
                     "paddle": ("Momentum", {"learning_rate": 0.01, "momentum": 0.9}), "exact": True},
    "nesterov": {"keras": ("SGD", {"learning_rate": 0.01, "momentum": 0.9, "nesterov": True}),
                 "paddle": ("Momentum", {"learning_rate": 0.01, "momentum": 0.9, "use_nesterov": True}),
                 "exact": True},
    "rmsprop": {"keras": ("RMSprop", {"learning_rate": 1e-3, "rho": 0.9, "momentum": 0.5, "centered": True,
                                      "epsilon": 1e-7}),
                "paddle": ("RMSProp", {"learning_rate": 1e-3, "rho": 0.9, "momentum": 0.5, "centered": True,
                                       "epsilon": 1e-7}), "exact": True},
    # Approximate cases: documented bounds (docs/MIGRATION.md), checked against the warning's estimate.
    "adam_paddle_eps": {"keras": ("Adam", {"learning_rate": 1e-3}),
                        "paddle": ("Adam", {"learning_rate": 1e-3, "epsilon": 1e-7}), "exact": False},
    "adagrad": {"keras": ("Adagrad", {"learning_rate": 0.01, "initial_accumulator_value": 0.1,
                                      "epsilon": 1e-7}),
                "paddle": ("Adagrad", {"learning_rate": 0.01, "initial_accumulator_value": 0.1,
                                       "epsilon": 1e-7}), "exact": False},
}

# The exact schedule pairs of docs/MIGRATION.md: (Keras schedule, Paddle scheduler) as (class, kwargs).
SCHEDULES: dict[str, tuple[tuple[str, dict], tuple[str, dict]]] = {
    "exponential": (("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.5}),
                    ("ExponentialDecay", {"learning_rate": 0.1, "gamma": 0.5 ** (1 / 10)})),
    "staircase": (("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.5,
                                        "staircase": True}),
                  ("StepDecay", {"learning_rate": 0.1, "step_size": 3, "gamma": 0.5})),
    "natural_exp": (("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 1,
                                          "decay_rate": float(np.exp(-0.3))}),
                    ("NaturalExpDecay", {"learning_rate": 0.1, "gamma": 0.3})),
    "piecewise": (("PiecewiseConstantDecay", {"boundaries": [6, 8], "values": [0.1, 0.05, 0.01]}),
                  ("PiecewiseDecay", {"boundaries": [7, 9], "values": [0.1, 0.05, 0.01]})),
    "multistep": (("PiecewiseConstantDecay", {"boundaries": [6, 8], "values": [0.1, 0.05, 0.025]}),
                  ("MultiStepDecay", {"learning_rate": 0.1, "milestones": [7, 9], "gamma": 0.5})),
    "polynomial_cycle": (("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 4,
                                              "end_learning_rate": 0.01, "power": 2.0, "cycle": True}),
                         ("PolynomialDecay", {"learning_rate": 0.1, "decay_steps": 4, "end_lr": 0.01,
                                              "power": 2.0, "cycle": True})),
    "polynomial": (("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 8,
                                        "end_learning_rate": 0.01, "power": 0.5}),
                   ("PolynomialDecay", {"learning_rate": 0.1, "decay_steps": 8, "end_lr": 0.01, "power": 0.5})),
    "inverse_time": (("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 2, "decay_rate": 0.5}),
                     ("InverseTimeDecay", {"learning_rate": 0.1, "gamma": 0.25})),
    "cosine": (("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 16, "alpha": 0.1}),
               ("CosineAnnealingDecay", {"learning_rate": 0.1, "T_max": 16, "eta_min": 0.01})),
    "warmup_cosine": (("CosineDecay", {"initial_learning_rate": 0.0, "decay_steps": 8, "alpha": 0.1,
                                       "warmup_target": 0.1, "warmup_steps": 7}),
                      ("LinearWarmup", {"learning_rate": ("CosineAnnealingDecay",
                                                          {"learning_rate": 0.1, "T_max": 8, "eta_min": 0.01}),
                                        "warmup_steps": 7, "start_lr": 0.0, "end_lr": 0.1})),
    "cosine_restarts": (("CosineDecayRestarts", {"initial_learning_rate": 0.1, "first_decay_steps": 3,
                                                 "t_mul": 2.0, "m_mul": 1.0, "alpha": 0.1}),
                        ("CosineAnnealingWarmRestarts", {"learning_rate": 0.1, "T_0": 3, "T_mult": 2,
                                                         "eta_min": 0.01})),
}
LR_STEPS = 10   # learning rates compared after the migration


def batches(seed: int, n: int, *, nchw: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` MNIST-shaped batches (images in [0, 1), labels 0..9), NCHW for Paddle, NHWC for Keras."""
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        x = rs.rand(BATCH, IMG, IMG, 1).astype("float32")
        y = rs.randint(0, 10, size=(BATCH,)).astype("int64")
        out.append((np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nchw else x, y))
    return out


def probe_images(nchw: bool, n: int = 64) -> np.ndarray:
    x = np.random.RandomState(4).rand(n, IMG, IMG, 1).astype("float32")
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nchw else x


# End to end (acceptance 4): a small synthetic MNIST-like dataset walked by a DataCursor.
E2E_SAMPLES, E2E_BATCH, E2E_SEED = 256, 32, 7
E2E_FIRST = 8 + 3        # Keras: epoch 0 (8 steps) and 3 steps of epoch 1, then the checkpoint
E2E_CONTINUE = 8         # then one epoch's worth of steps, in Paddle and (reference) in Keras


def e2e_dataset() -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(2024)
    y = rs.randint(0, 10, size=E2E_SAMPLES).astype("int64")
    x = rs.rand(E2E_SAMPLES, IMG, IMG, 1).astype("float32") * 0.5
    for i, label in enumerate(y):  # a learnable signal: a bright bar whose row is the label
        x[i, 2 + 2 * label: 4 + 2 * label, 4:24, 0] += 0.5
    return x, y


def write_json(directory: str | os.PathLike, name: str, data: Any) -> None:
    Path(directory, f"{name}.json").write_text(json.dumps(data, indent=1, default=float))


def read_json(directory: str | os.PathLike, name: str) -> Any:
    return json.loads(Path(directory, f"{name}.json").read_text())


def max_diff(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


# Structure twins (issue 12): the same network in both frameworks, paired by structure, not order.
TWINS = ("resnet", "unet", "mobilenet")
TWIN_IMG, TWIN_CLASSES = 16, 10
TWIN_SGD = {"learning_rate": 0.01, "momentum": 0.9}


def twin_batches(seed: int, n: int, *, nchw: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` batches of 16x16 RGB images and labels, NCHW for Paddle, NHWC for Keras."""
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        x = rs.rand(BATCH, TWIN_IMG, TWIN_IMG, 3).astype("float32")
        y = rs.randint(0, TWIN_CLASSES, size=(BATCH,)).astype("int64")
        out.append((np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nchw else x, y))
    return out


def twin_probe(nchw: bool) -> np.ndarray:
    x = np.random.RandomState(8).rand(16, TWIN_IMG, TWIN_IMG, 3).astype("float32")
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nchw else x


# PyTorch pairs (torch <-> Keras, torch <-> Paddle): the structure twins plus a Transformer encoder
# block, each trained with its own optimizer.  The torch side uses ckptcore_torch.keras_adam with a
# Keras partner (Keras adds Adam's epsilon to the uncorrected sqrt(v)) and torch's own Adam with a
# Paddle partner (both add it to the bias-corrected sqrt(v-hat)).
TORCH_TWINS = ("resnet", "unet", "mobilenet", "transformer")
TORCH_TWIN_OPT = {"resnet": "sgd", "unet": "adam", "mobilenet": "adamw", "transformer": "adamw"}
TORCH_OPTS: dict[str, dict[str, tuple[str, dict]]] = {
    "sgd": {"torch_keras": ("SGD", {"lr": 0.01, "momentum": 0.9}),
            "torch_paddle": ("SGD", {"lr": 0.01, "momentum": 0.9, "nesterov": True}),
            "keras": ("SGD", {"learning_rate": 0.01, "momentum": 0.9}),
            "paddle": ("Momentum", {"learning_rate": 0.01, "momentum": 0.9, "use_nesterov": True})},
    "adam": {"torch_keras": ("KerasAdam", {"lr": 1e-3}), "torch_paddle": ("Adam", {"lr": 1e-3}),
             "keras": ("Adam", {"learning_rate": 1e-3}), "paddle": ("Adam", {"learning_rate": 1e-3})},
    "adamw": {"torch_keras": ("KerasAdamW", {"lr": 1e-3, "weight_decay": 0.05}),
              "torch_paddle": ("AdamW", {"lr": 1e-3, "weight_decay": 0.05}),
              "keras": ("AdamW", {"learning_rate": 1e-3, "weight_decay": 0.05}),
              "paddle": ("AdamW", {"learning_rate": 1e-3, "weight_decay": 0.05})},
}
SEQ_LEN, SEQ_FEAT, SEQ_EMBED, SEQ_HEADS = 6, 4, 8, 2
# The Transformer block between Keras and Paddle (test_migration.py): Keras AdamW and Paddle's
# KerasAdamW (Keras' epsilon placement), so the continued runs must agree exactly.
KP_TRANSFORMER_OPT = {"keras": OPT_CASES["adamw"]["keras"], "paddle": OPT_CASES["adamw"]["paddle"]}


def seq_batches(seed: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` batches of [BATCH, SEQ_LEN, SEQ_FEAT] sequences and labels (the same in every framework)."""
    rs = np.random.RandomState(seed)
    return [(rs.randn(BATCH, SEQ_LEN, SEQ_FEAT).astype("float32"),
             rs.randint(0, TWIN_CLASSES, size=(BATCH,)).astype("int64")) for _ in range(n)]


def seq_probe() -> np.ndarray:
    return np.random.RandomState(9).randn(16, SEQ_LEN, SEQ_FEAT).astype("float32")


def pair_batches(name: str, seed: int, n: int, *, nchw: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    return seq_batches(seed, n) if name == "transformer" else twin_batches(seed, n, nchw=nchw)


def pair_probe(name: str, *, nchw: bool) -> np.ndarray:
    return seq_probe() if name == "transformer" else twin_probe(nchw)


# JAX pairs (JAX <-> PyTorch, Keras and Paddle): the four twins.  Beside PyTorch and Paddle, JAX
# trains with optax.sgd (Nesterov momentum), optax.adam or optax.adamw, whose counterparts add Adam's
# epsilon as Optax does (to the bias-corrected sqrt(v-hat)); beside Keras (whose Adam adds it to the
# uncorrected sqrt(v), which no Optax optimizer does) every twin trains with Nesterov SGD.
JAX_TWINS = TORCH_TWINS
JAX_PARTNERS = ("torch", "keras", "paddle")
JAX_TWIN_OPT = {"resnet": "sgd", "unet": "adam", "mobilenet": "adamw", "transformer": "adamw"}
JAX_OPTS: dict[str, dict[str, tuple[str, dict]]] = {
    "sgd": {"jax": ("sgd", {"learning_rate": 0.01, "momentum": 0.9, "nesterov": True}),
            "torch": ("SGD", {"lr": 0.01, "momentum": 0.9, "nesterov": True}),
            "paddle": ("Momentum", {"learning_rate": 0.01, "momentum": 0.9, "use_nesterov": True}),
            "keras": ("SGD", {"learning_rate": 0.01, "momentum": 0.9, "nesterov": True})},
    "adam": {"jax": ("adam", {"learning_rate": 1e-3}), "torch": ("Adam", {"lr": 1e-3}),
             "paddle": ("Adam", {"learning_rate": 1e-3})},
    "adamw": {"jax": ("adamw", {"learning_rate": 1e-3, "weight_decay": 0.05}),
              "torch": ("AdamW", {"lr": 1e-3, "weight_decay": 0.05}),
              "paddle": ("AdamW", {"learning_rate": 1e-3, "weight_decay": 0.05})},
}
# Data seeds of the runs each framework trains first (the other side continues on the same data).
JAX_DATA_SEED = {"jax": 1300, "torch": 1400, "keras": 1500, "paddle": 1600}


def jax_opt_key(name: str, partner: str) -> str:
    return "sgd" if partner == "keras" else JAX_TWIN_OPT[name]


def jax_opt(name: str, partner: str, side: str) -> tuple[str, dict]:
    """The optimizer spec ``side`` (``"jax"`` or the partner) uses for twin ``name`` of a pair."""
    return JAX_OPTS[jax_opt_key(name, partner)][side]


def jax_source(name: str, partner: str) -> str:
    """The JAX run a partner continues: one per twin and optimizer (partners share it)."""
    return f"j_{name}_{jax_opt_key(name, partner)}"
