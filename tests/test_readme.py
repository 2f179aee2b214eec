"""Every ```python block of README.md runs as written, twice, each in a fresh process.

How a block is run:

- Each block runs in a new Python process (the repository importable, cwd a fresh temporary
  folder), then a second time in the same folder: a snippet a user re-runs must not fail
  (``CheckpointExistsError``...) the second time.  A framework's block runs in a process that
  imports only that framework (TensorFlow and Paddle never share a process); it is skipped only
  when that framework is not installed here.  A JAX block runs on 8 CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, ``JAX_PLATFORMS=cpu``, as README
  tells a reader to try a mesh on a CPU) with ``JAX_COORDINATOR_ADDRESS`` on a free port.
- A block that mentions ``s3://`` runs against the moto S3 server of ``tests/conftest.py``:
  every bucket the block names is created there, and the process gets ``AWS_ENDPOINT_URL_S3``
  (what boto and s3fs use when a block passes no ``storage_options``, and what README's S3
  examples read for their ``endpoint_url``; ``S3_ENDPOINT_URL`` too) and test credentials, as
  README's "Trying the bucket examples locally" tells a reader to.  No block ever reaches AWS.
- The names a block assumes exist (``x_train``, ``model``, ``train_step``...) come from a
  *prelude*, code run before the block in the same process.  A block names its preludes in an
  HTML comment line right above its fence, which the rendered README does not show::

      <!-- prelude: keras-model -->

  (several: ``<!-- prelude: keras-model, keras-strategy -->``).  A block without a marker must be
  self-contained.  The preludes are :data:`PRELUDES` below; a new README block that needs other
  names adds a prelude here and names it in its marker.  A prelude defines only names: it never
  fixes up what the block itself does wrong.  The reader sees what a block assumes: the paragraph
  right above the marker starts with "Assumes" and names, in backticks, every name of the prelude
  the block uses without defining it.
- A block that opens a ``CheckpointManager("ROOT", ...)`` must leave a committed step there
  after its first run (an example loop that never reaches its save period saves nothing).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from _support import REPO, free_port, subprocess_env

README = REPO / "README.md"


@dataclass(frozen=True)
class Prelude:
    framework: str | None  # the one framework the block's process may import ("keras", "jax"...)
    code: str


PRELUDES: dict[str, Prelude] = {
    # A NumPy "model" trained by a few lines: what the framework-free loops assume.
    "numpy-loop": Prelude(None, """
        import numpy as np
        import ckptcore
        _g = np.random.default_rng(0)
        x_train = _g.standard_normal((96, 4)).astype(np.float32)
        y_train = (x_train.sum(1) > 0).astype(np.float32)
        epochs = EPOCHS = 2

        def train_step(params, x, y):
            err = x @ params["w"] - y
            params["w"] -= np.float32(0.1) * (x.T @ err / len(x)).astype(np.float32)
            return float((err ** 2).mean())

        def make_state(params, step):
            return ckptcore.TrainingState(model=dict(params), step=step)
        """),
    # A compiled Keras classifier with Dropout and Adam, its data, and a custom train step.
    "keras-model": Prelude("keras", """
        import numpy as np
        import tensorflow as tf
        import keras
        import ckptcore, ckptcore_keras
        keras.utils.set_random_seed(0)
        _g = np.random.default_rng(0)
        x_train = _g.standard_normal((256, 8)).astype(np.float32)
        y_train = _g.integers(0, 3, 256).astype(np.int64)
        epochs = EPOCHS = 2
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dropout(0.1), keras.layers.Dense(3)])
        optimizer = keras.optimizers.Adam(1e-3)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=optimizer, loss=loss_fn)
        strategy = tf.distribute.get_strategy()  # the default strategy: one device

        def make_model():
            return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                     keras.layers.Dense(3)])

        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        """),
    # A Paddle classifier, its dataset, Adam on a StepDecay schedule, and a hapi Model of it.
    "paddle-model": Prelude("paddle", """
        import numpy as np
        import paddle
        import ckptcore, ckptcore_paddle
        paddle.seed(0)
        _g = np.random.default_rng(0)

        class _Data(paddle.io.Dataset):
            def __init__(self, n):
                self.x = _g.standard_normal((n, 8)).astype(np.float32)
                self.y = _g.integers(0, 3, (n, 1)).astype(np.int64)
            def __getitem__(self, i):
                return self.x[i], self.y[i]
            def __len__(self):
                return len(self.x)

        train_ds = _Data(128)
        epochs = EPOCHS = E = 2
        net = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Dropout(0.1),
                                   paddle.nn.Linear(16, 3))
        sched = paddle.optimizer.lr.StepDecay(0.01, step_size=10)
        opt = optimizer = paddle.optimizer.Adam(learning_rate=sched, parameters=net.parameters())
        loss_fn = paddle.nn.CrossEntropyLoss()
        model = paddle.Model(net)
        model.prepare(opt, loss_fn)
        """),
    # A PyTorch classifier, its dataset, Adam on a StepLR schedule, and a LightningModule of it.
    "torch-model": Prelude("torch", """
        import numpy as np
        import torch
        import ckptcore, ckptcore_torch
        torch.manual_seed(0)
        torch.set_num_threads(1)
        _g = np.random.default_rng(0)
        train_ds = torch.utils.data.TensorDataset(
            torch.from_numpy(_g.standard_normal((128, 8)).astype(np.float32)),
            torch.from_numpy(_g.integers(0, 3, 128)))
        epochs = EPOCHS = E = 2
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                  torch.nn.Linear(16, 3))
        opt = optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        loss_fn = torch.nn.CrossEntropyLoss()
        """),
    # A Flax NNX classifier with Dropout, its nnx.Optimizer (Adam), a jitted step, and a bare
    # parameter pytree with its Optax state.
    "jax-model": Prelude("jax", """
        import numpy as np
        import jax, jax.numpy as jnp, optax
        from flax import nnx
        import ckptcore, ckptcore_jax
        _g = np.random.default_rng(0)
        x_train = _g.standard_normal((128, 8)).astype(np.float32)
        y_train = _g.integers(0, 3, 128).astype(np.int32)
        epochs = EPOCHS = 2

        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.hidden = nnx.Linear(8, 16, rngs=rngs)
                self.drop = nnx.Dropout(0.1, rngs=rngs)
                self.out = nnx.Linear(16, 3, rngs=rngs)

            def __call__(self, x):
                return self.out(self.drop(jax.nn.relu(self.hidden(x))))

        model = MLP(nnx.Rngs(params=0, dropout=1))
        tx = optax.adam(1e-3)
        opt = optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def train_step(model, opt, x, y):
            def loss_fn(m):
                return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss

        params = {"dense": {"kernel": jnp.asarray(_g.standard_normal((8, 3)), jnp.float32),
                            "bias": jnp.zeros(3, jnp.float32)}}
        opt_state = tx.init(params)
        """),
}

# Blocks known to be broken as they stand, by the sha256 of their exact text, with the reason: a
# changed block is run for real.  Each entry is an expected failure (strict: once such a block
# runs, the entry must go).  Issue 12 has other owners rewriting these sections' blocks.
KNOWN_BROKEN: dict[str, str] = {
}

MARKER = re.compile(r"^<!--\s*prelude:\s*(.+?)\s*-->$")
CODE_MARKER = re.compile(r"^#\s*prelude:", re.MULTILINE)  # the old in-code marker: not shown any more
FRAMEWORK_MODULES = {"keras": ("tensorflow", "keras", "ckptcore_keras"),
                     "paddle": ("paddle", "ckptcore_paddle"),
                     "torch": ("torch", "ckptcore_torch", "lightning"),
                     "jax": ("jax", "ckptcore_jax", "flax", "optax", "orbax")}
# What a framework imports itself: Keras 3 loads JAX when it is installed, whatever its backend.
ALSO_LOADS = {"keras": ("jax",)}
# A JAX block runs on 8 CPU devices (README says how to get them) and, for a block that starts
# jax.distributed, with its coordinator on a free port (two blocks at once must not share one).
JAX_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


@dataclass(frozen=True)
class Block:
    section: str
    line: int  # of the opening fence, 1-based
    code: str
    marked: tuple[str, ...] = ()  # the preludes its marker line names
    above: str = ""  # the paragraph right above the block (and its marker)

    @property
    def id(self) -> str:
        return f"L{self.line}-{re.sub(r'[^A-Za-z0-9]+', '-', self.section).strip('-')}"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()

    @property
    def preludes(self) -> list[str]:
        return list(self.marked)

    @property
    def assumed(self) -> set[str]:
        """The preludes' names the block uses without binding them itself."""
        defined: set[str] = set()
        for p in self.preludes:
            defined |= _bound(ast.parse(textwrap.dedent(PRELUDES[p].code)), top_level=True)
        tree = ast.parse(self.code)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        return (used & defined) - _bound(tree)

    @property
    def framework(self) -> str | None:
        """The one framework the block needs: its preludes' or the one it imports."""
        wanted = {PRELUDES[p].framework for p in self.preludes if p in PRELUDES} - {None}
        for framework, modules in FRAMEWORK_MODULES.items():
            if re.search(rf"\b(import|from)\s+({'|'.join(modules)})\b", self.code):
                wanted.add(framework)
        assert len(wanted) <= 1, f"README block at line {self.line} needs {sorted(wanted)} in one process"
        return next(iter(wanted), None)


def other_frameworks(framework: str | None) -> list[str]:
    """The modules a block of ``framework`` must not leave imported: the other frameworks' (but
    what ``framework`` loads itself)."""
    return [m for f, mods in FRAMEWORK_MODULES.items() if f != framework for m in mods[:1]
            if m not in ALSO_LOADS.get(framework or "", ())]


def _bound(tree: ast.AST, top_level: bool = False) -> set[str]:
    """Names ``tree`` binds (assignments, loop and ``with`` targets, defs, classes, imports)."""
    nodes = tree.body if top_level else list(ast.walk(tree))
    if top_level:
        nodes = [n for stmt in nodes for n in ast.walk(stmt)
                 if not isinstance(n, (ast.FunctionDef, ast.ClassDef)) or n in tree.body]
    names: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return names


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block opened by exactly ```python, with the ``## `` section it is in, the
    preludes its marker line (``<!-- prelude: ... -->`` right above the fence) names and the
    paragraph above that."""
    blocks, section, current, start = [], "", None, 0
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if current is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.strip() == "```python":
                current, start = [], number
        elif line.strip() == "```":
            i = start - 2  # the line above the fence
            marked: tuple[str, ...] = ()
            m = MARKER.match(lines[i].strip()) if i >= 0 else None
            if m:
                marked = tuple(p.strip() for p in m.group(1).split(",") if p.strip())
                i -= 1
            while i >= 0 and not lines[i].strip():
                i -= 1
            paragraph = []
            while i >= 0 and lines[i].strip() and not lines[i].startswith(("```", "#")):
                paragraph.insert(0, lines[i])
                i -= 1
            blocks.append(Block(section, start, "\n".join(current) + "\n", marked,
                                " ".join(paragraph)))
            current = None
        else:
            current.append(line)
    assert current is None, f"README.md: the ```python block at line {start} is never closed"
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks_and_known_preludes():
    """The extraction finds the README's blocks, and every marker names a prelude that exists."""
    assert len(BLOCKS) >= 3
    assert any("save_state" in b.code for b in BLOCKS)
    for b in BLOCKS:
        unknown = [p for p in b.preludes if p not in PRELUDES]
        assert not unknown, f"README block at line {b.line}: no prelude named {unknown} " \
                            f"(known: {sorted(PRELUDES)})"
    assert readme_blocks("## A\n```python\nx = 1\n```\n```bash\nno\n```\n## B\nAssumes `y`.\n"
                         "<!-- prelude: numpy-loop -->\n```python\ny\n```\n") == [
        Block("A", 2, "x = 1\n"), Block("B", 11, "y\n", ("numpy-loop",), "Assumes `y`.")]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_states_what_it_assumes(block):
    """No harness marker in the shown code; a block that needs a prelude says right above it,
    in one paragraph starting "Assumes", every name it takes from the prelude."""
    assert not CODE_MARKER.search(block.code), (
        f"README block at line {block.line} shows the test's prelude marker in its code: put it on "
        "an HTML comment line above the fence (<!-- prelude: NAME -->)")
    assumed = block.assumed
    if not block.preludes:
        return
    assert assumed, f"README block at line {block.line} names preludes but uses none of their names"
    assert block.above.startswith("Assumes"), (
        f"README block at line {block.line} takes {sorted(assumed)} from its prelude; the line "
        f"above it must say so (\"Assumes `name`, ...\"), not {block.above[:80]!r}")
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", block.above))
    missing = sorted(assumed - named)
    assert not missing, f"README block at line {block.line} uses {missing} without saying it assumes them"


def _s3_env(request, code: str) -> dict[str, str]:
    """Environment for a block that uses S3: the session's moto server, with its buckets made."""
    buckets = sorted(set(re.findall(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])", code)))
    if not buckets:
        return {}
    options = request.getfixturevalue("s3_storage_options")
    import s3fs
    fs = s3fs.S3FileSystem(**options)
    for bucket in buckets:
        if not fs.exists(bucket):
            fs.mkdir(bucket)
    endpoint = options["client_kwargs"]["endpoint_url"]
    return {"S3_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_ACCESS_KEY_ID": options["key"], "AWS_SECRET_ACCESS_KEY": options["secret"],
            "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
@pytest.mark.slow
def test_readme_block_runs_as_written_twice(block, request, tmp_path):
    framework = block.framework
    if framework is not None:
        for module in FRAMEWORK_MODULES[framework]:
            if importlib.util.find_spec(module) is None:  # only an absent framework skips
                pytest.skip(f"{framework} is not installed ({module})")
    if block.digest in KNOWN_BROKEN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_BROKEN[block.digest], strict=True))
    preludes = "\n".join(textwrap.dedent(PRELUDES[p].code) for p in block.preludes)
    script = tmp_path / "block.py"
    others = other_frameworks(framework)
    postlude = (f"\nimport sys as _sys\nassert not {{m for m in {others!r} if m in _sys.modules}}, "
                f"'a README block imported another framework than {framework}'\n")
    script.write_text(f"{preludes}\n# --- README.md line {block.line} ---\n{block.code}{postlude}")
    work = tmp_path / "work"
    work.mkdir()
    env = subprocess_env()
    env.pop("AWS_PROFILE", None)
    env.update(_s3_env(request, block.code))
    if framework == "jax":
        env.update(JAX_ENV, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}")
    for run in ("first", "second"):
        done = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, (
            f"README.md block at line {block.line} ({block.section}, preludes {block.preludes}) "
            f"failed on its {run} run with exit {done.returncode}\n--- stdout\n{done.stdout[-2000:]}"
            f"\n--- stderr\n{done.stderr[-5000:]}")
        if run == "first":
            _assert_roots_saved(block, request, work)


def _assert_roots_saved(block: Block, request, work: Path) -> None:
    """Each ``CheckpointManager("ROOT"`` of the block holds a committed step after its run."""
    import ckptcore
    for root in re.findall(r"CheckpointManager\(\s*\"([^\"]+)\"", block.code):
        if root.startswith("s3://"):
            listed = ckptcore.list_checkpoints(root, storage_options=request.getfixturevalue(
                "s3_storage_options"))
        else:
            listed = ckptcore.list_checkpoints(work / root)
        assert listed, (f"README block at line {block.line} ({block.section}) saved nothing under "
                        f"{root}: its loop never reaches a save (add a final save after the loop)")


def _bucket_note() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("**Trying the bucket examples locally.**")
    return text[start:text.index("```\n", text.index("```bash", start) + 7)]


@pytest.mark.slow
def test_the_bucket_note_sets_up_what_the_s3_blocks_need(s3_storage_options, tmp_path):
    """The README's "Trying the bucket examples locally" steps, run as shown (the moto server is
    the session's, on its own port): the environment they export and their bucket command are
    all a block without storage options needs."""
    note = _bucket_note()
    assert "moto_server -p 5000" in note and "ThreadedMotoServer" in note
    exported = dict(re.findall(r"\b(AWS_[A-Z0-9_]+)=(\S+)", note.split("export ", 1)[1].split("\n")[0]))
    assert exported == {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:5000", "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing"}
    command = re.search(r'^python -c "(.+)"$', note, re.MULTILINE).group(1)
    buckets = {b for block in BLOCKS for b in re.findall(r"s3://([a-z0-9][a-z0-9.-]+[a-z0-9])/", block.code)}
    assert buckets and all(f"'{b}'" in command for b in buckets), (buckets, command)
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("AWS_")}
    env.update(exported, AWS_ENDPOINT_URL_S3=s3_storage_options["client_kwargs"]["endpoint_url"])
    check = ("import ckptcore, numpy as np\n"
             "s = ckptcore.TrainingState(model={'w': np.ones(2)}, step=1)\n"
             "ckptcore.save_state('s3://bucket/note-check/step-1', s, overwrite=True)\n"
             "assert ckptcore.load_state('s3://bucket/note-check/step-1').step == 1\n")
    for code in (command, command, check):  # the bucket command twice: a re-run must not fail
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
