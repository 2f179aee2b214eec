"""Every ```python block of docs/CURSOR.md and docs/MIGRATION.md runs as written, twice.

A document's blocks run in order, each in a fresh Python process whose working folder is the same
for the whole document (the docs' relative paths, ``runs/...``, land there), and then the whole
document runs a second time in the same folder and against the same bucket: a user re-running
the examples must not meet ``CheckpointExistsError`` or a checkpoint the first run left behind.

- A block that needs a framework runs in a process that imports only that framework (TensorFlow
  and Paddle never share a process); the document is skipped only when that framework is not
  installed here.  The framework is the one the block imports, or its preludes'.
- The names a block leaves to the reader (``dataset``, the Paddle ``MNIST`` network...) come from
  a *prelude* named by an HTML comment line right above the block, which the rendered page does
  not show: ``<!-- prelude: paddle-mnist -->`` (several: ``<!-- prelude: a, b -->``).  A prelude
  defines names only; it never fixes what the block itself does wrong.
- ``s3://`` URLs go to the session's moto server (``tests/conftest.py``), with their buckets
  created, as tests/test_readme.py does for README.md.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from _support import REPO, subprocess_env
from test_readme import FRAMEWORK_MODULES, _s3_env, other_frameworks

DOCS = ("docs/CURSOR.md", "docs/MIGRATION.md")

PRELUDES: dict[str, tuple[str | None, str]] = {
    # What MIGRATION.md's Keras block trains on: a small MNIST-shaped dataset.
    "keras-mnist": ("keras", """
        import numpy as np
        dataset = np.random.default_rng(0).standard_normal((300, 28, 28, 1)).astype(np.float32)
        """),
    # The Paddle side: the same CNN written in Paddle, its data (NCHW) and F.
    "paddle-mnist": ("paddle", """
        import numpy as np
        import paddle
        import paddle.nn.functional as F
        paddle.seed(0)
        _g = np.random.default_rng(1)
        dataset = _g.standard_normal((300, 1, 28, 28)).astype(np.float32)
        images = paddle.to_tensor(dataset)
        labels = paddle.to_tensor(_g.integers(0, 10, (300, 1)).astype(np.int64))

        class MNIST(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.conv1 = paddle.nn.Conv2D(1, 20, 5, padding=2)
                self.pool1 = paddle.nn.MaxPool2D(2, 2)
                self.conv2 = paddle.nn.Conv2D(20, 20, 5, padding=2)
                self.pool2 = paddle.nn.MaxPool2D(2, 2)
                self.fc = paddle.nn.Linear(980, 10)

            def forward(self, x):
                x = self.pool2(F.relu(self.conv2(self.pool1(F.relu(self.conv1(x))))))
                return self.fc(paddle.reshape(x, [x.shape[0], 980]))
        """),
    # The objects MIGRATION.md's second block builds, for its third.
    "paddle-mnist-objects": ("paddle", """
        import ckptcore
        from ckptcore_paddle.keras_adam import KerasAdam
        net = MNIST()
        sched = paddle.optimizer.lr.ExponentialDecay(1e-3, gamma=0.5 ** (1 / 100))
        opt = KerasAdam(learning_rate=sched, parameters=net.parameters())
        """),
}

MARKER = re.compile(r"^<!--\s*prelude:\s*(.+?)\s*-->$")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    code: str
    preludes: tuple[str, ...]

    @property
    def framework(self) -> str | None:
        wanted = {PRELUDES[p][0] for p in self.preludes} - {None}
        for framework, modules in FRAMEWORK_MODULES.items():
            if re.search(rf"\b(import|from)\s+({'|'.join(modules)})\b", self.code):
                wanted.add(framework)
        assert len(wanted) <= 1, f"{self.doc} block at line {self.line} needs {sorted(wanted)}"
        return next(iter(wanted), None)


def doc_blocks(doc: str, text: str) -> list[Block]:
    """Every block opened by exactly ```python, with the preludes its marker line names."""
    blocks, current, start, marker, last = [], None, 0, (), ""
    for number, line in enumerate(text.splitlines(), 1):
        if current is None:
            if line.strip() == "```python":
                m = MARKER.match(last.strip())
                marker = tuple(p.strip() for p in m.group(1).split(",") if p.strip()) if m else ()
                current, start = [], number
            elif line.strip():
                last = line
        elif line.strip() == "```":
            blocks.append(Block(doc, start, "\n".join(current) + "\n", marker))
            current, last = None, ""
        else:
            current.append(line)
    assert current is None, f"{doc}: the ```python block at line {start} is never closed"
    return blocks


def _blocks(doc: str) -> list[Block]:
    return doc_blocks(doc, (REPO / doc).read_text(encoding="utf-8"))


def test_the_docs_blocks_are_found_with_known_preludes():
    cursor, migration = _blocks("docs/CURSOR.md"), _blocks("docs/MIGRATION.md")
    assert len(cursor) >= 2 and len(migration) == 3
    assert [b.framework for b in migration] == ["keras", "paddle", "paddle"]
    for b in cursor + migration:
        unknown = [p for p in b.preludes if p not in PRELUDES]
        assert not unknown, f"{b.doc} line {b.line}: no prelude named {unknown}"
    assert doc_blocks("d", "x\n<!-- prelude: a, b -->\n```python\ny = 1\n```\n```python\nz\n```\n") == [
        Block("d", 3, "y = 1\n", ("a", "b")), Block("d", 6, "z\n", ())]


def run_doc(doc: str, request, work: Path) -> None:
    """Run every python block of ``doc`` in order, each in its own process, in ``work``."""
    blocks = _blocks(doc)
    for b in blocks:
        if b.framework is not None:
            for module in FRAMEWORK_MODULES[b.framework]:
                if importlib.util.find_spec(module) is None:
                    pytest.skip(f"{doc} needs {b.framework}, which is not installed ({module})")
    env = subprocess_env()
    env.pop("AWS_PROFILE", None)
    env.update(_s3_env(request, "".join(b.code for b in blocks)))
    for run in ("first", "second"):
        for b in blocks:
            others = other_frameworks(b.framework)
            preludes = "\n".join(textwrap.dedent(PRELUDES[p][1]) for p in b.preludes)
            script = work.parent / f"{Path(doc).stem}-{b.line}.py"
            script.write_text(
                f"{preludes}\n# --- {doc} line {b.line} ---\n{b.code}\n"
                f"import sys as _sys\nassert not {{m for m in {others!r} if m in _sys.modules}}, "
                f"'a block imported another framework than {b.framework}'\n")
            done = subprocess.run([sys.executable, str(script)], cwd=work, env=env,
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (
                f"{doc} block at line {b.line} (preludes {list(b.preludes)}) failed on its {run} "
                f"run with exit {done.returncode}\n--- stdout\n{done.stdout[-2000:]}"
                f"\n--- stderr\n{done.stderr[-5000:]}")


@pytest.mark.parametrize("doc", DOCS, ids=[Path(d).stem for d in DOCS])
@pytest.mark.slow
def test_doc_blocks_run_as_written_twice(doc, request, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    run_doc(doc, request, work)
    if Path(doc).stem == "CURSOR":  # (one run of the doc serves both checks)
        check_the_cursor_doc_saves_the_cursor_where_load_state_and_inspect_find_it(work)


def check_the_cursor_doc_saves_the_cursor_where_load_state_and_inspect_find_it(work):
    # The doc used to save state.data["cursor"] = cursor.state_dict(): load_state(url, cursor=c)
    # then failed (SchemaError: missing field(s) 'batch_size') and ckpt inspect showed
    # "position None".  Its checkpoints now hold the cursor as the data section itself.
    import ckptcore

    root = work / "runs" / "cursor"
    listed = ckptcore.list_checkpoints(root)
    assert listed and listed[-1].step == 24  # 500 samples in batches of 64: 8 steps an epoch, 3 epochs
    cursor = ckptcore.DataCursor(500, batch_size=64, seed=17)
    state = ckptcore.load_state(listed[-1].url, cursor=cursor)
    assert state.data == cursor.state_dict() and (cursor.epoch, cursor.position) == (3, 0)
    shown = subprocess.run([sys.executable, "-m", "ckptcore.cli", "inspect", listed[-1].url], capture_output=True, text=True,
                           env=subprocess_env(), timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "position None" not in shown.stdout
    assert re.search(r"data\s+epoch 3 / position 0 / seed 17", shown.stdout), shown.stdout
