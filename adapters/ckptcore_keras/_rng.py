"""TensorFlow's and Keras' global random generators as plain values.

``state.rng`` keys added next to ckptcore's ``"python"`` and ``"numpy"``:

* ``"tensorflow"``: ``{"state": [int, ...], "algorithm": int}`` of ``tf.random``'s
  global ``Generator``, or ``None`` if none was created yet (capture never creates it).
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

_GLOBAL_SEED_GENERATOR = "global_seed_generator"
_GLOBAL_RANDOM_SEED = "global_random_seed"


def capture_framework_rng() -> dict[str, Any]:
    from keras.src.backend.common import global_state
    from tensorflow.python.ops import stateful_random_ops

    out: dict[str, Any] = {}
    gen = stateful_random_ops.global_generator
    out["tensorflow"] = None if gen is None else {
        "state": [int(x) for x in gen.state.numpy().tolist()], "algorithm": int(gen.algorithm)}
    sg = global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)
    seed = global_state.get_global_attribute(_GLOBAL_RANDOM_SEED)
    out["keras"] = {"state": None if sg is None else [int(x) for x in sg.state.numpy().tolist()],
                    "seed": None if seed is None else int(seed)}
    return out


def restore_framework_rng(rng: dict[str, Any]) -> None:
    """Put back what :func:`capture_framework_rng` took; call before restoring Python's RNG.

    Creating Keras' global seed generator draws from Python's ``random``, so Python's
    state must be restored afterwards.
    """
    import tensorflow as tf
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import global_seed_generator

    keras_rng = rng.get("keras")
    if keras_rng is not None:
        if not isinstance(keras_rng, dict) or "state" not in keras_rng:
            raise SchemaError("rng['keras'] must be a mapping with 'state' and 'seed'")
        global_state.set_global_attribute(_GLOBAL_RANDOM_SEED, keras_rng.get("seed"))
        if keras_rng["state"] is None:
            # The run had not used it yet: it will be created from Python's random, as then.
            global_state.set_global_attribute(_GLOBAL_SEED_GENERATOR, None)
        else:
            sg = global_seed_generator()
            sg.state.assign(np.asarray(keras_rng["state"], dtype=sg.state.dtype))
    tf_rng = rng.get("tensorflow")
    if tf_rng is not None:
        if not isinstance(tf_rng, dict) or {"state", "algorithm"} - tf_rng.keys():
            raise SchemaError("rng['tensorflow'] must be a mapping with 'state' and 'algorithm'")
        state = np.asarray(tf_rng["state"], dtype=np.int64)
        gen = tf.random.get_global_generator()
        if int(gen.algorithm) == int(tf_rng["algorithm"]) and tuple(gen.state.shape) == state.shape:
            gen.reset(state)
        else:
            tf.random.set_global_generator(
                tf.random.Generator.from_state(state, alg=int(tf_rng["algorithm"])))
