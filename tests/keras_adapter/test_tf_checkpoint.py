"""import_tf_checkpoint / export_tf_checkpoint against TensorFlow's own reader and restore."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptcore_keras  # noqa: E402
from _keras_helpers import assert_same_bits, batches, same_bits, accumulating_train_step, snapshot  # noqa: E402
from ckptcore.errors import CheckpointNotFoundError, SchemaError  # noqa: E402

SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


def create_model():  # a small CNN classifier
    return keras.models.Sequential([keras.Input((8, 8)), keras.layers.Flatten(),
                                    keras.layers.Dense(16, activation="relu"),
                                    keras.layers.Dropout(0.2), keras.layers.Dense(10)])


@pytest.fixture(scope="module")
def tf_manager_run(tmp_path_factory):
    """A custom loop saving with tf.train.Checkpoint + CheckpointManager(max_to_keep=2), 3 steps."""
    keras.utils.set_random_seed(0)
    log_dir = str(tmp_path_factory.mktemp("tf_manager_run"))
    rs = np.random.RandomState(0)
    x_train, y_train = rs.rand(32, 8, 8).astype("float32"), rs.randint(0, 10, 32)
    model = create_model()
    optimizer = keras.optimizers.SGD(learning_rate=0.001, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, log_dir, max_to_keep=2)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(y_train, model(x_train, training=True))
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        manager.save()
    return model, optimizer, log_dir


def test_import_equals_tf_reader(tf_manager_run):
    model, optimizer, log_dir = tf_manager_run
    state = ckptcore_keras.import_tf_checkpoint(log_dir)  # the manager's latest: ckpt-3
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(log_dir))
    keys = {k for k, _ in tf.train.list_variables(tf.train.latest_checkpoint(log_dir))}
    used = {"_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter" + SUFFIX}

    def expect(value, key):
        used.add(key)
        assert same_bits(np.asarray(value), reader.get_tensor(key)), key

    for i, v in enumerate(model.trainable_variables):
        expect(state.model[v.path], f"optimizer/_trainable_variables/{i}{SUFFIX}")
    for j, ov in enumerate(optimizer.variables[2:], start=2):
        param = next(v.path for v in model.trainable_variables
                     if ov.path == f"{optimizer.name}/{v.path.replace('/', '_')}_momentum")
        expect(state.optimizer.slots[param]["momentum"], f"optimizer/_variables/{j}{SUFFIX}")
    expect(np.int64(state.optimizer.step), "optimizer/_iterations" + SUFFIX)
    expect(np.float32(state.optimizer.hyperparams["learning_rate"]), "optimizer/_learning_rate" + SUFFIX)
    assert used == keys
    assert state.optimizer.kind == "sgd" and state.step == 3
    assert set(state.model) == {v.path for v in model.trainable_variables}  # no seed state in TF files


def test_import_older_prefix_and_missing(tf_manager_run, tmp_path):
    _, _, log_dir = tf_manager_run
    older = ckptcore_keras.import_tf_checkpoint(f"{log_dir}/ckpt-2")
    assert older.step == 2
    with pytest.raises(CheckpointNotFoundError):
        ckptcore_keras.import_tf_checkpoint(f"{log_dir}/ckpt-1")  # deleted by max_to_keep=2
    with pytest.raises(CheckpointNotFoundError):
        ckptcore_keras.import_tf_checkpoint(tmp_path)


def test_imported_state_restores_into_fresh_model(tf_manager_run):
    model, optimizer, log_dir = tf_manager_run
    state = ckptcore_keras.import_tf_checkpoint(log_dir)
    fresh, opt = create_model(), keras.optimizers.SGD(learning_rate=0.001, momentum=0.9)
    report = ckptcore_keras.restore(state, fresh, opt, strict=False)
    assert report.unexpected == ()
    assert len(report.missing) == 1 and report.missing[0].endswith("seed_generator_state")
    keep = [i for i, v in enumerate(model.variables) if "seed_generator" not in v.path]
    assert_same_bits([model.variables[i].numpy() for i in keep], [fresh.variables[i].numpy() for i in keep])
    assert_same_bits([v.numpy() for v in optimizer.variables], [v.numpy() for v in opt.variables])


def test_import_with_model_uses_capture_names(tf_manager_run):
    model, optimizer, log_dir = tf_manager_run
    state = ckptcore_keras.import_tf_checkpoint(log_dir, model=model, optimizer=optimizer)
    captured = ckptcore_keras.capture(model, optimizer, rng=False)
    assert set(state.model) == {n for n in captured.model if "seed_generator" not in n}
    for name, value in state.model.items():
        assert same_bits(value, captured.model[name]), name
    assert state.params == {n: p for n, p in captured.params.items() if n in state.model}
    assert state.optimizer.hyperparams == captured.optimizer.hyperparams


def test_export_restores_with_assert_consumed(tf_manager_run, tmp_path):
    model, optimizer, _ = tf_manager_run
    state = ckptcore_keras.capture(model, optimizer, rng=False)
    path = ckptcore_keras.export_tf_checkpoint(state, tmp_path / "out" / "ckpt", create_model(),
                                               keras.optimizers.SGD(learning_rate=0.001, momentum=0.9))
    target, opt = create_model(), keras.optimizers.SGD(learning_rate=0.001, momentum=0.9)
    opt.build(target.trainable_variables)
    tf.train.Checkpoint(model=target, optimizer=opt).restore(path).assert_consumed()
    keep = [i for i, v in enumerate(model.variables) if "seed_generator" not in v.path]
    assert_same_bits([model.variables[i].numpy() for i in keep], [target.variables[i].numpy() for i in keep])
    assert_same_bits([v.numpy() for v in optimizer.variables], [v.numpy() for v in opt.variables])


def test_file_format_reads_and_writes_through_the_adapter(tf_manager_run, tmp_path):
    """What ``ckpt import``/``ckpt export`` call: ``ADAPTER.formats``."""
    (fmt,) = ckptcore_keras.ADAPTER.formats
    model, optimizer, log_dir = tf_manager_run
    assert fmt.detect(log_dir) and not fmt.detect(str(tmp_path))
    state = fmt.read(log_dir, model=None, optimizer=None, unused=None)  # None: option not given
    assert_same_bits(list(state.model.values()),
                     list(ckptcore_keras.import_tf_checkpoint(log_dir).model.values()))
    dst = str(tmp_path / "out" / "ckpt")
    with pytest.raises(TypeError, match="model"):
        fmt.write(state, dst)
    with pytest.raises(TypeError, match="bogus"):
        fmt.write(state, dst, model=create_model(), bogus=1)
    state = ckptcore_keras.capture(model, optimizer, rng=False)  # with its seed generators
    target = create_model()
    written = fmt.write(state, dst, model=target,
                        optimizer=keras.optimizers.SGD(learning_rate=0.001, momentum=0.9))
    assert fmt.detect(dst) and written == dst
    again = fmt.read(dst, model=target)
    now = ckptcore_keras.capture(target, rng=False)  # the target holds the state, under its names
    assert_same_bits(list(now.model.values()), list(state.model.values()))
    assert again.model.keys() <= now.model.keys()
    assert_same_bits([again.model[n] for n in again.model], [now.model[n] for n in again.model])
    assert_same_bits([s["momentum"] for s in again.optimizer.slots.values()],
                     [s["momentum"] for s in state.optimizer.slots.values()])


def _adam_bn_model():
    x = inp = keras.Input((5,))
    x = keras.layers.Dense(6)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.1)(x)
    model = keras.Model(inp, keras.layers.Dense(1)(x))
    inner = keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.9),
                                  gradient_accumulation_steps=3)
    model.compile(keras.optimizers.LossScaleOptimizer(inner, initial_scale=64.0,
                                                      dynamic_growth_steps=2), "mse")
    return model


def test_import_adam_schedule_accumulation_loss_scale(tmp_path):
    keras.utils.set_random_seed(4)
    model = _adam_bn_model()
    for x, y in batches("reg5", 7):
        model.train_on_batch(x, y)
    opt = model.optimizer
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "w"))
    state = ckptcore_keras.import_tf_checkpoint(path, optimizer=opt)
    captured = ckptcore_keras.capture(model, rng=False)
    assert [n for n in captured.model if n not in state.model] == \
        [n for n in captured.model if "seed_generator" in n]
    for name, value in state.model.items():
        assert same_bits(value, captured.model[name]), name
    got, want = state.optimizer, captured.optimizer
    assert (got.kind, got.step, got.hyperparams) == (want.kind, want.step, want.hyperparams)
    assert got.slots.keys() == want.slots.keys()
    for p, slots in want.slots.items():
        assert slots.keys() == got.slots[p].keys()
        assert_same_bits(list(slots.values()), list(got.slots[p].values()), p)
    acc_got, acc_want = state.accumulation, captured.accumulation
    assert (acc_got.every, acc_got.count) == (acc_want.every, acc_want.count) == (3, 1)
    assert_same_bits(list(acc_got.buffers.values()), list(acc_want.buffers.values()))
    ls_got, ls_want = got.extra["loss_scale"], want.extra["loss_scale"]
    assert ls_got["config"] == ls_want["config"]
    assert ls_got["variables"].keys() == ls_want["variables"].keys()
    assert_same_bits(list(ls_got["variables"].values()), list(ls_want["variables"].values()))
    assert state.schedule == captured.schedule
    with pytest.raises(SchemaError, match="optimizer="):
        ckptcore_keras.import_tf_checkpoint(path)


def test_import_without_optimizer_names_kind_and_slots(tmp_path):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.AdamW(0.01), "mse")
    for x, y in batches("reg5", 2):
        model.train_on_batch(x, y)
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "m"))  # compiled: optimizer rides along
    state = ckptcore_keras.import_tf_checkpoint(path)
    captured = ckptcore_keras.capture(model, rng=False)
    assert state.optimizer.kind == "adamw" and state.step == 2
    for p, slots in captured.optimizer.slots.items():
        assert list(state.optimizer.slots[p]) == ["momentum", "velocity"]
        assert_same_bits(list(slots.values()), list(state.optimizer.slots[p].values()), p)


def test_train_step_model_attribute_variables(tmp_path):
    keras.utils.set_random_seed(4)
    model = accumulating_train_step()
    for x, y in batches("onehot16", 5):
        model.train_on_batch(x, y)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "s"))
    state = ckptcore_keras.import_tf_checkpoint(path, model=model)
    name = f"{model.name}/n_acum_step"
    assert int(state.model[name]) == 1
    fresh = accumulating_train_step()
    report = ckptcore_keras.restore(state, fresh, strict=False)
    assert report.unexpected == ()
    # TF does not write variables held in Python lists: the custom train_step's accumulators are missing.
    assert sorted(n.split("/", 1)[1] for n in report.missing) == \
        [f"gradient_accumulation/{i}" for i in range(4)]
    assert same_bits(fresh.n_acum_step.numpy(), model.n_acum_step.numpy())
    assert_same_bits(snapshot(model)[:4], snapshot(fresh)[:4])


FACTORY = '''
import keras
def build():
    model = keras.models.Sequential([keras.Input((8, 8)), keras.layers.Flatten(),
                                     keras.layers.Dense(16, activation="relu"),
                                     keras.layers.Dropout(0.2), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(learning_rate=0.001, momentum=0.9)
    optimizer.build(model.trainable_variables)
    return model, optimizer
'''


def test_cli_round_trip_of_a_dropout_model_needs_no_strict(tf_manager_run, tmp_path, run_python):
    """``ckpt import`` of a tf.train.Checkpoint, then ``ckpt export --no-strict`` through a model
    factory: TensorFlow restores the exported files into a fresh model with the saved weights.
    (A Dropout layer's seed generator is not in TensorFlow's checkpoint, so a strict export into
    the model refuses: the state lacks it.)"""
    model, optimizer, log_dir = tf_manager_run
    (tmp_path / "factory_mod.py").write_text(FACTORY)
    dst, prefix = tmp_path / "ckpt", tmp_path / "out" / "exported"
    cli = ["-m", "ckptcore.cli"]
    run_python(*cli, "import", log_dir, str(dst))
    import subprocess
    import sys
    from _support import subprocess_env
    env = subprocess_env(tmp_path)
    strict = subprocess.run([sys.executable, *cli, "export", str(dst), str(prefix), "--to", "tf-checkpoint",
                             "--model", "factory_mod:build"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert strict.returncode == 2 and "seed_generator" in strict.stderr, strict.stderr[-2000:]
    done = subprocess.run([sys.executable, *cli, "export", str(dst), str(prefix), "--to", "tf-checkpoint",
                           "--model", "factory_mod:build", "--no-strict"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = create_model()
    tf.train.Checkpoint(model=fresh).restore(done.stdout.split(" -> ")[-1].strip()).expect_partial()
    for a, b in zip(model.trainable_variables, fresh.trainable_variables):
        assert same_bits(a.numpy(), b.numpy()), a.path
