"""TensorFlow's, Keras' and (on Keras' PyTorch backend) PyTorch's global random generators.

``state.rng`` keys added next to ckptcore's ``"python"`` and ``"numpy"``:

* ``"tensorflow"``: ``{"state": [int, ...], "algorithm": int}`` of ``tf.random``'s
  global ``Generator``, or ``None`` if none was created yet (capture never creates it);
  absent when TensorFlow is not imported (Keras on JAX or PyTorch without ``tf.data``).
* ``"torch"``: on Keras' PyTorch backend, ``torch.get_rng_state()`` as a ``uint8`` array
  (the format of ``ckptcore_torch``).
* ``"keras"``: ``{"state": [seed, counter], "seed": int | None}``: the global
  ``SeedGenerator`` behind ``keras.random.*(seed=None)`` (``state`` is ``None`` if it
  does not exist yet) and the seed last given to ``keras.utils.set_random_seed``.

Per-layer seed generators (Dropout...) are model variables, not RNG entries.
TensorFlow's stateful ops seeded by ``tf.random.set_seed`` keep hidden per-op
state that cannot be captured; Keras 3 layers do not use them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptcore.errors import SchemaError

from ._backend import backend, loaded_tensorflow, seed_words
from ._tensors import np_dtype

_GLOBAL_SEED_GENERATOR = "global_seed_generator"
_GLOBAL_RANDOM_SEED = "global_random_seed"


def capture_framework_rng() -> dict[str, Any]:
    from keras.src.backend.common import global_state

    out: dict[str, Any] = {}
    tf = loaded_tensorflow()  # TensorFlow's generator only where TensorFlow runs (never imported)
    if tf is not None:
        from tensorflow.python.ops import stateful_random_ops

        gen = stateful_random_ops.global_generator
        out["tensorflow"] = None if gen is None else {
            "state": [int(x) for x in gen.state.numpy().tolist()], "algorithm": int(gen.algorithm)}
    sg = global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)
    seed = global_state.get_global_attribute(_GLOBAL_RANDOM_SEED)
    out["keras"] = {"state": None if sg is None else [int(x) for x in sg.state.numpy().tolist()],
                    "seed": None if seed is None else int(seed)}
    if backend() == "torch":  # what keras.utils.set_random_seed seeds, too
        import torch

        out["torch"] = torch.get_rng_state().numpy().copy()
    return out


def restore_framework_rng(rng: dict[str, Any]) -> None:
    """Put back what :func:`capture_framework_rng` took; call before restoring Python's RNG.

    Creating Keras' global seed generator draws from Python's ``random``, so Python's
    state must be restored afterwards.  Keras' seed words move between backends (see
    ``_backend.seed_words``); TensorFlow's generator is restored where TensorFlow is imported,
    PyTorch's on the PyTorch backend (a state from another backend has none: left as it is).
    """
    _restore_keras(rng.get("keras"))
    tf_rng = rng.get("tensorflow")
    if tf_rng is not None:
        if not isinstance(tf_rng, dict) or {"state", "algorithm"} - tf_rng.keys():
            raise SchemaError("rng['tensorflow'] must be a mapping with 'state' and 'algorithm'")
        if loaded_tensorflow() is not None:
            _restore_tf(tf_rng)
    torch_rng = rng.get("torch")
    if torch_rng is not None and backend() == "torch":
        import torch

        arr = np.asarray(torch_rng)
        if arr.dtype != np.uint8 or arr.ndim != 1:
            raise SchemaError("rng['torch'] must be a 1-D uint8 array (torch.get_rng_state())")
        torch.set_rng_state(torch.from_numpy(arr.copy()))


def _restore_keras(keras_rng: Any) -> None:
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import global_seed_generator

    if keras_rng is None:
        return
    if not isinstance(keras_rng, dict) or "state" not in keras_rng:
        raise SchemaError("rng['keras'] must be a mapping with 'state' and 'seed'")
    global_state.set_global_attribute(_GLOBAL_RANDOM_SEED, keras_rng.get("seed"))
    if keras_rng["state"] is None:
        # The run had not used it yet: it will be created from Python's random, as then.
        global_state.set_global_attribute(_GLOBAL_SEED_GENERATOR, None)
    else:
        sg = global_seed_generator()
        try:
            words = seed_words(keras_rng["state"], np_dtype(sg.state))
        except ValueError as e:
            raise SchemaError(f"rng['keras']['state']: {e}") from None
        sg.state.assign(words)


def _restore_tf(tf_rng: dict[str, Any]) -> None:
    import tensorflow as tf

    state = np.asarray(tf_rng["state"], dtype=np.int64)
    gen = tf.random.get_global_generator()
    if int(gen.algorithm) == int(tf_rng["algorithm"]) and tuple(gen.state.shape) == state.shape:
        gen.reset(state)
    else:
        tf.random.set_global_generator(
            tf.random.Generator.from_state(state, alg=int(tf_rng["algorithm"])))
