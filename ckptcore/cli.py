"""``ckpt``: thin verbs over the public API.  No logic lives here, and no framework is needed."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

import numpy as np

from . import api, _io
from ._storage import Store
from .errors import CheckpointError


def _options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``key=value`` pairs as storage options; values parse as JSON when they can."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"ckpt: --storage-option expects key=value, got {pair!r}")
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        node = out
        *parents, leaf = key.split(".")  # client_kwargs.endpoint_url=... nests
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = parsed
    return out


class _Progress:
    """A one-line progress bar on stderr, shown only when stdout is a terminal."""

    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = max(total, 1), 0, label
        self.enabled = sys.stdout.isatty() and total > (64 << 20)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.enabled:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%}")
            sys.stderr.flush()

    def __enter__(self) -> _Progress:
        self._token = _io.progress.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _io.progress.reset(self._token)
        if self.enabled:
            sys.stderr.write("\n")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_inspect(args: argparse.Namespace, so: dict) -> int:
    info = api.inspect(args.url, storage_options=so)
    if args.json:
        d = {k: getattr(info, k) for k in info.__dataclass_fields__ if k != "tensors"}
        d["tensors"] = [dict(t.__dict__) for t in info.tensors]
        print(json.dumps(d, indent=2, default=str))
        return 0
    print(f"checkpoint  {info.url}")
    print(f"format      v{info.format_version}, written by ckptcore {info.library.get('ckptcore')}")
    print(f"step        {info.step}    epoch {info.epoch}    framework {info.framework or '-'}")
    print(f"sections    {', '.join(info.sections)}")
    if info.data:
        d = info.data
        print(f"data        epoch {d.get('epoch')} / position {d.get('position')} / seed {d.get('seed')}"
              + (f"  ({d.get('num_samples')} samples, batch {d.get('batch_size')})"
                 if "num_samples" in d else ""))
    print(f"tensors     {len(info.tensors)} in {len(info.shards)} shard(s), {_size(info.nbytes)}")
    _print_tree(info.tensors)
    return 0


def _print_tree(tensors) -> None:
    last: list[str] = []
    for t in tensors:
        parts = t.name.split("/")
        common = 0
        while common < min(len(last), len(parts) - 1) and last[common] == parts[common]:
            common += 1
        for depth in range(common, len(parts) - 1):
            print("  " * (depth + 1) + parts[depth] + "/")
        shape = "x".join(map(str, t.shape)) or "scalar"
        print("  " * len(parts) + f"{parts[-1]:<28} {t.dtype:<10} {shape:<16} {_size(t.nbytes)}")
        last = parts[:-1]


def cmd_verify(args: argparse.Namespace, so: dict) -> int:
    info = api.inspect(args.url, storage_options=so)
    with _Progress(info.nbytes, "verifying"):
        problems = api.verify(args.url, storage_options=so)
    for p in problems:
        print(f"BAD  {p}")
    if problems:
        print(f"{args.url}: {len(problems)} problem(s)")
        return 1
    print(f"{args.url}: OK ({len(info.tensors)} tensors, {_size(info.nbytes)})")
    return 0


def _flat(state) -> dict[str, np.ndarray]:
    from . import _codec
    enc = _codec.encode_state(state)
    return dict(zip(enc.names, enc.arrays))


def cmd_diff(args: argparse.Namespace, so: dict) -> int:
    a, b = (_flat(api.load_state(u, storage_options=so)) for u in (args.a, args.b))
    differ = 0
    for name in sorted(set(a) | set(b)):
        if name not in b or name not in a:
            print(f"{'-' if name not in b else '+'} {name}  (only in {'A' if name not in b else 'B'})")
            differ += 1
        elif a[name].shape != b[name].shape or a[name].dtype != b[name].dtype:
            print(f"~ {name}  {a[name].dtype}{list(a[name].shape)} vs {b[name].dtype}{list(b[name].shape)}")
            differ += 1
        elif a[name].tobytes() != b[name].tobytes():
            print(f"~ {name}  max abs diff {_maxdiff(a[name], b[name])}")
            differ += 1
    print(f"{differ} of {len(set(a) | set(b))} tensors differ")
    return 1 if differ else 0


def _maxdiff(x: np.ndarray, y: np.ndarray) -> str:
    try:
        return f"{float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))):.6g}"
    except (TypeError, ValueError):
        return "n/a (non-numeric)"


def cmd_ls(args: argparse.Namespace, so: dict) -> int:
    root = Store(args.root, so)
    found = 0
    for entry in sorted(root.listdir(), key=lambda e: e.name):
        if not entry.is_dir or entry.name.startswith("."):
            continue
        try:
            info = api.inspect(root.child(entry.name).url, storage_options=so)
        except CheckpointError:
            continue
        found += 1
        print(f"{entry.name:<32} step {info.step:<8} epoch {info.epoch:<4} "
              f"{info.framework or '-':<7} {_size(info.nbytes)}")
    if not found:
        print(f"no committed checkpoints under {args.root}")
    return 0


def cmd_gc(args: argparse.Namespace, so: dict) -> int:
    from .manager import CheckpointManager, _is_root

    if not _is_root(Store(args.root, so)):
        # A typo or a step folder: refuse before the lock file would be created there.
        raise FileNotFoundError(f"{args.root}: no checkpoint root here (no step-* folders or "
                                "leftovers of saves)")
    # Takes the root's writer lock: refused (LockedError, naming the holder) while a run writes.
    with CheckpointManager(args.root, storage_options=so) as mgr:
        removed = mgr.gc(grace=args.grace)
    for url in removed:
        print(f"removed {url}")
    print(f"{len(removed)} leftover(s) removed under {args.root}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckpt", description="Inspect, verify and compare ckptcore checkpoints.")
    p.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option (repeatable; dots nest: client_kwargs.endpoint_url=...)")
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("inspect", help="show a checkpoint's contents from its manifest")
    s.add_argument("url")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("verify", help="check every checksum; exit 1 names each bad tensor, "
                                      "exit 2 when the checkpoint cannot be read at all")
    s.add_argument("url")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("diff", help="which tensors differ between two checkpoints, and by how much")
    s.add_argument("a")
    s.add_argument("b")
    s.set_defaults(fn=cmd_diff)
    s = sub.add_parser("ls", help="list the committed checkpoints under a folder")
    s.add_argument("root")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("gc", help="remove leftovers of interrupted saves under a manager's root")
    s.add_argument("root")
    s.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                   help="only leftovers untouched this long (default: 900, or CKPTCORE_GC_GRACE)")
    s.set_defaults(fn=cmd_gc)
    s = sub.add_parser("import", help="turn a tf.train.Checkpoint or .pdparams/.pdopt into a ckptcore checkpoint")
    s.add_argument("src", help="a tf.train.Checkpoint prefix or directory, or a .pdparams file")
    s.add_argument("dst", help="where the ckptcore checkpoint goes (any fsspec URL)")
    s.add_argument("--pdopt", help="the .pdopt file that goes with a .pdparams (default: beside it)")
    s.add_argument("--model", metavar="MODULE:FACTORY",
                   help="builds the Keras model (and optimizer) whose variable paths name the tensors")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(fn=cmd_import)
    s = sub.add_parser("export", help="write a ckptcore checkpoint as another framework's native files")
    s.add_argument("src", help="a ckptcore checkpoint URL")
    s.add_argument("dst", help="the file prefix to write (PREFIX.pdparams / PREFIX.index ...)")
    s.add_argument("--to", required=True, choices=["pdparams", "tf-checkpoint"])
    s.add_argument("--model", metavar="MODULE:FACTORY",
                   help="builds the Keras model (and optimizer) to export through (tf-checkpoint only)")
    s.set_defaults(fn=cmd_export)
    s = sub.add_parser("convert", help="migrate a checkpoint to another framework's layout (Keras <-> Paddle)")
    s.add_argument("src", help="a ckptcore checkpoint URL")
    s.add_argument("dst", help="a ckptcore checkpoint URL, or a file prefix with --to pdparams/tf-checkpoint")
    s.add_argument("--to", required=True, choices=["paddle", "keras", "pdparams", "tf-checkpoint"])
    s.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="builds the target model (and optimizer, and for Paddle a scheduler) that gives the "
                        "target's structure")
    s.add_argument("--approximate", action="store_true",
                   help="convert what cannot continue exactly (schedules...) with a warning instead of failing")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(fn=cmd_convert)
    s = sub.add_parser("demo", help="train a tiny model, SIGKILL it mid-epoch, resume, compare")
    s.add_argument("--root", default=None, help="where checkpoints go (any fsspec URL; default: a temp folder)")
    s.add_argument("--framework", default="numpy", choices=["numpy", "keras", "paddle"])
    s.set_defaults(fn=cmd_demo)
    return p


def load_factory(spec: str | None) -> tuple[Any, ...]:
    """Call ``module:factory`` and return ``(model, optimizer or None, ...)``."""
    if not spec or ":" not in spec:
        raise SystemExit("ckpt: --model expects MODULE:FACTORY, e.g. mymodels:build")
    import importlib
    sys.path.insert(0, os.getcwd())
    module, _, attr = spec.partition(":")
    built = getattr(importlib.import_module(module), attr)()
    return tuple(built) if isinstance(built, (tuple, list)) else (built, None)  # type: ignore[return-value]


def cmd_import(args: argparse.Namespace, so: dict) -> int:
    if args.src.endswith(".pdparams"):
        from ckptcore_paddle import import_paddle_files
        pdopt = args.pdopt or args.src[: -len(".pdparams")] + ".pdopt"
        state = import_paddle_files(args.src, pdopt if os.path.exists(pdopt) else None)
    else:
        from ckptcore_keras import import_tf_checkpoint
        model, optimizer = load_factory(args.model) if args.model else (None, None)
        state = import_tf_checkpoint(args.src, model=model, optimizer=optimizer)
    info = api.save_state(args.dst, state, storage_options=so, overwrite=args.overwrite)
    print(f"imported {args.src} -> {info.url} ({len(info.tensors)} tensors, {_size(info.nbytes)})")
    return 0


def cmd_export(args: argparse.Namespace, so: dict) -> int:
    state = api.load_state(args.src, storage_options=so)
    if args.to == "pdparams":
        from ckptcore_paddle import export_paddle_files
        written = export_paddle_files(state, args.dst)
    else:
        from ckptcore_keras import export_tf_checkpoint
        model, optimizer = load_factory(args.model)
        written = export_tf_checkpoint(state, args.dst, model, optimizer)
    print(f"exported {args.src} -> {written}")
    return 0


def cmd_convert(args: argparse.Namespace, so: dict) -> int:
    import warnings

    target = {"pdparams": "paddle", "tf-checkpoint": "keras"}.get(args.to, args.to)
    built = load_factory(args.model)
    model, optimizer = built[0], built[1] if len(built) > 1 else None
    scheduler = built[2] if len(built) > 2 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = api.convert(args.src, target, model, optimizer, scheduler=scheduler,
                            approximate=args.approximate, storage_options=so)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if args.to == "pdparams":
        from ckptcore_paddle import export_paddle_files
        written: Any = export_paddle_files(state, args.dst)
    elif args.to == "tf-checkpoint":
        from ckptcore_keras import export_tf_checkpoint
        written = export_tf_checkpoint(state, args.dst, model, optimizer)
    else:
        written = api.save_state(args.dst, state, storage_options=so, overwrite=args.overwrite).url
    print(f"converted {args.src} ({state.metadata.get('migrated_from', {}).get('framework')}) -> "
          f"{written} ({target})")
    return 0


def cmd_demo(args: argparse.Namespace, so: dict) -> int:
    from .demo import run_demo
    return run_demo(args.root, args.framework, so)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb.  Exit codes: 0 done (``verify``: intact), 1 differences or problems found
    (``verify``, ``diff``), 2 the input cannot be read or the arguments are wrong, 3 an internal
    error (a bug: reported in one line, with the traceback only when ``CKPT_TRACEBACK=1``)."""
    args = build_parser().parse_args(argv)
    # --storage-option may also follow the verb
    try:
        return int(args.fn(args, _options(args.storage_option)) or 0)
    except (CheckpointError, OSError, ValueError, TypeError, LookupError) as e:
        print(f"ckpt {args.verb}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a one-line report instead of a traceback
        if os.environ.get("CKPT_TRACEBACK") == "1":
            raise
        print(f"ckpt {args.verb}: internal error: {type(e).__name__}: {e} (please report it; "
              "CKPT_TRACEBACK=1 shows where)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
