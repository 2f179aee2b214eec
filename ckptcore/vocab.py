"""The vocabulary adapters and migration share: ParamInfo kinds, roles and layouts, and plain values.

A :class:`~ckptcore.ParamInfo` describes a parameter in words both sides of a migration read the
same way.  These constants are those words; an adapter maps its framework's layer classes and
variable names onto them, and :mod:`ckptcore.migrate` matches and converts by them alone.  A new
framework adds no word here unless it brings a layer family no other framework has.

Layout letters (one per axis, in the array's own order):

=======  =====================================================================
letter   axis
=======  =====================================================================
``i``    input features or channels
``o``    output features or channels
``h w``  kernel height and width (``d`` depth for 3-D kernels)
``k``    kernel length of a 1-D convolution
``m``    depthwise channel multiplier
``v d``  vocabulary and embedding dimension
``e``    model (embedding) dimension of attention
``h d``  (attention) heads and the per-head dimension
=======  =====================================================================

Recurrent layers store the *gate order* as their layout (``ifco``: input, forget, cell, output;
``zrh``/``rzc``: the two GRU orders) and their axis order in ``attrs["axes"]`` (``io`` or ``oi``).
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["Kind", "Role", "GATE_ORDERS", "plain"]


class Kind(str, enum.Enum):
    """Layer families (``ParamInfo.kind``).  A ``str`` enum: compares equal to the plain word."""

    DENSE = "dense"
    EINSUM_DENSE = "einsum_dense"
    EMBEDDING = "embedding"
    CONV1D = "conv1d"
    CONV2D = "conv2d"
    CONV3D = "conv3d"
    DEPTHWISE_CONV1D = "depthwise_conv1d"
    DEPTHWISE_CONV2D = "depthwise_conv2d"
    SEPARABLE_CONV1D = "separable_conv1d"
    SEPARABLE_CONV2D = "separable_conv2d"
    CONV1D_TRANSPOSE = "conv1d_transpose"
    CONV2D_TRANSPOSE = "conv2d_transpose"
    CONV3D_TRANSPOSE = "conv3d_transpose"
    BATCH_NORM = "batch_norm"
    LAYER_NORM = "layer_norm"
    GROUP_NORM = "group_norm"
    INSTANCE_NORM = "instance_norm"
    UNIT_NORM = "unit_norm"
    LSTM = "lstm"
    GRU = "gru"
    SIMPLE_RNN = "simple_rnn"
    MULTI_HEAD_ATTENTION = "multi_head_attention"
    PRELU = "prelu"
    CUSTOM = "custom"  # a variable no layer family describes (raw attributes, user variables)

    def __str__(self) -> str:
        return self.value


class Role(str, enum.Enum):
    """A parameter's part in its layer (``ParamInfo.role``)."""

    KERNEL = "kernel"
    BIAS = "bias"
    GAMMA = "gamma"
    BETA = "beta"
    MOVING_MEAN = "moving_mean"
    MOVING_VARIANCE = "moving_variance"
    RECURRENT_KERNEL = "recurrent_kernel"
    RECURRENT_BIAS = "recurrent_bias"
    EMBEDDINGS = "embeddings"
    DEPTHWISE_KERNEL = "depthwise_kernel"
    POINTWISE_KERNEL = "pointwise_kernel"
    ALPHA = "alpha"
    SEED_STATE = "seed_state"  # a layer's RNG state (Dropout's seed generator): not a weight

    def __str__(self) -> str:
        return self.value


# Recurrent families and the gate orders their frameworks use.
GATE_ORDERS = {Kind.LSTM: ("ifco",), Kind.GRU: ("zrh", "rzc"), Kind.SIMPLE_RNN: (None,)}


def plain(value: Any) -> Any:
    """``value`` as msgpack-able plain data: containers recursively, numbers and strings as they are,
    NumPy scalars and arrays as Python numbers and lists, anything else as its ``str``.

    Used wherever a framework object's settings go into a state (layer attributes, optimizer
    hyperparameters, schedule configs), so that a checkpoint never holds a framework type.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalars and 0-d arrays
    if callable(item) and getattr(value, "ndim", 0) == 0:
        try:
            return plain(item())
        except (TypeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        try:
            return plain(tolist())
        except (TypeError, ValueError):
            pass
    return str(value)
