"""``ckpt``: thin verbs over the public API.  No logic lives here, and no framework is needed.

The verbs that touch other frameworks (``import``, ``export``, ``convert``, ``demo``) take their
choices from the adapter registry: each adapter declares its native file formats
(:class:`~ckptcore.adapter.FileFormat`) and its demo model; this module names no framework.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from typing import Any, Iterator, Mapping, Sequence

from . import _io, api, registry
from ._diff import diff
from ._storage import Store
from ._version import __version__
from .adapter import FileFormat
from .errors import CheckpointError, CheckpointNotFoundError
from ._manifest import MANIFEST_NAME
from .layout import check_grace, gc, is_root, list_checkpoints

log = logging.getLogger("ckptcore")


class _UsageExit(SystemExit):
    """A usage error found after argparse: exit 2 as argparse's own (the README's "the arguments
    are wrong"), the message already printed on stderr; ``str()`` is the message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


def _usage_error(message: str) -> _UsageExit:
    print(message, file=sys.stderr)
    return _UsageExit(message)


def _options(pairs: Sequence[str] | None, option: str = "--storage-option/-o") -> dict[str, Any]:
    """``key=value`` pairs as storage options; values parse as JSON when they can."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise _usage_error(f"ckpt: {option} expects key=value (e.g. -o anon=true), "
                               f"got {pair!r}")
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


def _is_tty(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a ``\r`` progress bar belongs there, not in a log file)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class _Progress:
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = max(total, 1), 0, label
        self.enabled = _is_tty(sys.stderr) and total > (64 << 20)

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


def _epoch(info: api.CheckpointInfo) -> int:
    """The epoch to show: the state's own, or the data cursor's when a custom loop left the state's
    ``epoch`` at 0 and only its cursor knows how far the run got."""
    cursor_epoch = info.data.get("epoch") if isinstance(info.data, Mapping) else None
    if info.epoch == 0 and isinstance(cursor_epoch, int) and cursor_epoch > 0:
        log.debug("ckpt: %s records epoch 0; showing its data cursor's epoch %d",
                  info.url, cursor_epoch)
        return cursor_epoch
    return info.epoch


def _inspect(url: str, so: dict) -> api.CheckpointInfo:
    """``api.inspect``, with a pointer to ``ckpt ls`` when ``url`` is a manager's root."""
    try:
        return api.inspect(url, storage_options=so)
    except CheckpointNotFoundError as e:
        try:
            root = is_root(Store(url, dict(so)))
        except (OSError, CheckpointError):  # cannot list it either: the original error says enough
            root = False
        if root:
            raise CheckpointNotFoundError(
                f"{url} is a run's root (a CheckpointManager folder), not a checkpoint: "
                f"`ckpt ls {url}` lists its checkpoints; inspect one of them") from e
        raise


def cmd_inspect(args: argparse.Namespace, so: dict) -> int:
    info = _inspect(args.url, so)
    if args.json:
        d = {k: getattr(info, k) for k in info.__dataclass_fields__ if k != "tensors"}
        d["tensors"] = [dict(t.__dict__) for t in info.tensors]
        print(json.dumps(d, indent=2, default=str))
        return 0
    print(f"checkpoint  {info.url}")
    print(f"format      v{info.format_version}, written by ckptcore {info.library.get('ckptcore')}")
    epoch = _epoch(info)
    shown = f"{epoch} (the data cursor's)" if epoch != info.epoch else str(epoch)
    print(f"step        {info.step}    epoch {shown}    framework {info.framework or '-'}")
    print(f"sections    {', '.join(info.sections)}")
    if info.data:
        d = info.data
        print(f"data        epoch {d.get('epoch')} / position {d.get('position')} / seed {d.get('seed')}"
              + (f"  ({d.get('num_samples')} samples, batch {d.get('batch_size')})"
                 if "num_samples" in d else ""))
    n, chunks = _count(info)
    print(f"tensors     {n}{chunks} in {len(info.shards)} shard(s), {_size(info.nbytes)}")
    _print_tree(info.tensors)
    return 0


def _count(info: Any) -> tuple[int, str]:
    """The number of tensors, and " (30 chunks)" when chunked tensors have more rows."""
    if info.format_version < 3:
        return len(info.tensors), ""
    tensors = len({t.name for t in info.tensors})
    return tensors, (f" ({len(info.tensors)} chunks)" if tensors != len(info.tensors) else "")


def _chunking(chunks: list) -> str:
    """How a tensor is cut, from its rows (TensorInfo): "" for one whole chunk, else e.g.
    "3 chunks along dim 0: 0..13 13..25 25..37" or the boxes, and the share held when the
    chunks do not cover the whole (one rank's part of a sharded array)."""
    g = chunks[0].global_shape
    if len(chunks) == 1 and chunks[0].shape == g:
        return ""
    total = math.prod(g)
    held = sum(math.prod(c.shape) for c in chunks)
    cut = [d for d in range(len(g)) if any(c.shape[d] != g[d] for c in chunks)]
    shown = sorted(chunks, key=lambda c: c.start)
    if len(cut) == 1:
        d = cut[0]
        spans = [f"{c.start[d]}..{c.start[d] + c.shape[d]}" for c in shown]
        text = f"{len(chunks)} chunk(s) along dim {d}: "
    else:
        spans = ["[" + ", ".join(f"{a}:{a + n}" for a, n in zip(c.start, c.shape)) + "]"
                 for c in shown]
        text = f"{len(chunks)} chunk(s): "
    text += " ".join(spans[:6]) + (f" ... ({len(spans) - 6} more)" if len(spans) > 6 else "")
    if held != total:
        text += f"  (holds {held} of {total} elements)"
    return text


def _print_tree(tensors) -> None:
    """The tensors as a tree of their names' folders, each folder once (its tensors gathered in
    the order they first appear, wherever the manifest lists them), in columns aligned whatever
    the depth."""
    groups: dict[str, list] = {}
    for t in tensors:  # (the rows of a chunked tensor share its name)
        groups.setdefault(t.name, []).append(t)
    tree: dict[str, Any] = {}  # folder -> subtree; a tensor's leaf name -> its rows (a list)
    for name, rows in groups.items():
        *folders, leaf = name.split("/")
        node = tree
        for f in folders:
            node = node.setdefault(f + "/", {})
        node[leaf] = rows
    lines: list[tuple[str, list | None]] = []

    def walk(node: dict, depth: int) -> None:
        for key, value in node.items():
            lines.append(("  " * (depth + 1) + key, None if isinstance(value, dict) else value))
            if isinstance(value, dict):
                walk(value, depth + 1)

    walk(tree, 0)
    width = max([30] + [len(text) + 1 for text, rows in lines if rows is not None])
    for text, rows in lines:
        if rows is None:
            print(text)
            continue
        t = rows[0]
        whole = t.global_shape if t.global_shape is not None else t.shape
        shape = "x".join(map(str, whole)) or "scalar"
        size = _size(sum(r.nbytes for r in rows))
        cut = _chunking(rows) if t.global_shape is not None else ""
        print(f"{text:<{width}} {t.dtype:<10} {shape:<16} {size}" + (f"   {cut}" if cut else ""))


def cmd_verify(args: argparse.Namespace, so: dict) -> int:
    if args.deep:
        return _verify_deep(args, so)
    if args.repair_from:
        raise ValueError("--repair-from needs --deep (it repairs a scrubbed root)")
    info = _inspect(args.url, so)
    with _Progress(info.nbytes, "verifying"):
        problems = api.verify(args.url, storage_options=so)
    for p in problems:
        print(f"BAD  {p}")
    if problems:
        print(f"{args.url}: {len(problems)} problem(s)")
        return 1
    n, chunks = _count(info)
    print(f"{args.url}: OK ({n} tensors{chunks}, every chunk checked, {_size(info.nbytes)})"
          if chunks else f"{args.url}: OK ({n} tensors, {_size(info.nbytes)})")
    return 0


def _verify_deep(args: argparse.Namespace, so: dict) -> int:
    from ._scrub import scrub

    report = scrub(args.url, repair_from=args.repair_from or (), storage_options=so)
    for line in report.problems:
        print(f"DAMAGED  {line}")
    for name in report.repaired:
        print(f"REPAIRED {name}")
    for name in report.broken:
        print(f"BROKEN   {name}")
    what = (f"{len(report.steps)} step(s), {report.blobs} blob(s) hashed" if report.deduplicated
            else f"{len(report.steps)} step(s) verified")
    print(f"{args.url}: {what}, {_size(report.bytes_read)} read: {len(report.damaged)} damaged, "
          f"{len(report.repaired)} repaired, {len(report.broken)} still broken")
    return 1 if report.broken else 0


def _section(name: str) -> str:
    """The section a tensor (or a chunk's key, ``name@[start]``) belongs to: ``model/dense/kernel``
    -> ``model``."""
    return name.split("/", 1)[0]


def cmd_diff(args: argparse.Namespace, so: dict) -> int:
    keys = None if args.keys is None else [k.strip() for k in args.keys.split(",") if k.strip()]
    if keys is not None and not keys:
        raise ValueError("--keys expects section names, e.g. --keys model,optimizer")
    result = diff(args.a, args.b, storage_options=so)
    differences, same, read = result.differences, result.same, result.read
    if keys is not None:
        # (the library compares every section; the filter applies to what it found)
        present = {_section(n) for n in (*same, *(d.name for d in differences))}
        unknown = [k for k in keys if k not in present]
        if unknown:
            raise ValueError(f"--keys: no tensors of section(s) {', '.join(unknown)} in either "
                             f"checkpoint (sections with tensors: {', '.join(sorted(present)) or 'none'})")
        differences = tuple(d for d in differences if _section(d.name) in keys)
        same = tuple(n for n in same if _section(n) in keys)
        read = tuple(n for n in read if _section(n) in keys)
    for d in differences:
        print(d.describe())
    print(f"{len(differences)} of {len(differences) + len(same)} tensors differ "
          f"({len(read)} read, the rest compared by checksum)"
          + (f" in {', '.join(keys)}" if keys is not None else ""))
    return 1 if differences else 0


def cmd_ls(args: argparse.Namespace, so: dict) -> int:
    store = Store(args.root, dict(so))
    local_missing = not store.exists()
    if local_missing and not args.backup:  # a typo or a missing bucket is not an empty run
        raise FileNotFoundError(f"{args.root} does not exist (no such folder or bucket)")
    if local_missing:
        # A fresh machine: the local root is not there (yet), the backup's listing is what matters.
        if not Store(args.backup, dict(so)).exists():
            raise FileNotFoundError(f"{args.root} does not exist, nor does the backup "
                                    f"{args.backup} (no such folder or bucket)")
        print(f"(the local root {args.root} is missing; listing the backup {args.backup} only)",
              file=sys.stderr)
    found = [] if local_missing else list_checkpoints(args.root, storage_options=so)
    if not found and store.exists(MANIFEST_NAME) and not is_root(store):
        # one checkpoint's folder, not a run's root (as inspect/verify of a root say the reverse)
        raise CheckpointNotFoundError(
            f"{args.root} is one checkpoint, not a run's root (a CheckpointManager folder): "
            f"`ckpt inspect {args.root}` shows it")
    backup = {} if not args.backup else {c.step: c for c in list_checkpoints(args.backup,
                                                                            storage_options=so)}
    local = {c.step: c for c in found}
    if args.json:
        rows = []
        for step in sorted(set(local) | set(backup)):
            c = local.get(step) or backup[step]
            row: dict[str, Any] = {"step": c.step, "folder": c.name, "url": c.url}
            if c.info is None:
                row["problem"] = c.problem
            else:
                info = c.info
                metrics = info.metadata.get("metrics") if isinstance(info.metadata, Mapping) else None
                row.update(saved_step=info.step, epoch=_epoch(info), framework=info.framework,
                           bytes=info.nbytes, created=info.created, metrics=metrics)
            row["tiers"] = [t for t, d in (("local", local), ("backup", backup)) if step in d]
            rows.append(row)
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if (local or backup) and _is_tty(sys.stdout):
        # For a reader, not a script (which gets the rows alone, or --json): the folder's step
        # is the manager's (save(step=...), often a batch count), "step N" the state's own.
        print(f"{'FOLDER (step saved as)':<32} {'SAVED STEP':<13} {'EPOCH':<10} {'FRAMEWORK':<9} "
              f"{'SIZE':>10}  {'SAVED AT':<19}  METRICS" + (" TIERS" if args.backup else ""))
    for step in sorted(set(local) | set(backup)):
        c = local.get(step) or backup[step]
        tiers = ("" if not args.backup else
                 " " + "+".join(t for t, d in (("local", local), ("backup", backup)) if step in d))
        if c.info is None:
            print(f"{c.name:<32} step {c.step:<8} unreadable: {c.problem}{tiers}")
            continue
        info = c.info
        print(f"{c.name:<32} step {info.step:<8} epoch {_epoch(info):<4} "
              f"{info.framework or '-':<9} {_size(info.nbytes):>10}  {_when(info.created)}  "
              f"{_metrics(info.metadata)}{tiers}")
    if not found and not backup:
        print(f"no committed checkpoints under {args.root}" +
              (f" or {args.backup}" if args.backup else ""))
    return 0


def _when(created: float) -> str:
    """A save time as local time, to the second."""
    import time
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
    except (TypeError, ValueError, OverflowError, OSError):
        return f"{'?':<19}"


def _metrics(metadata: Any) -> str:
    """``metadata["metrics"]`` as ``loss=0.5 acc=0.91``; "-" when there are none."""
    metrics = metadata.get("metrics") if isinstance(metadata, Mapping) else None
    if not isinstance(metrics, Mapping) or not metrics:
        return "-"
    return " ".join(f"{k}={v:.6g}" if isinstance(v, (int, float)) and not isinstance(v, bool)
                    else f"{k}={v}" for k, v in metrics.items())


def cmd_sync(args: argparse.Namespace, so: dict) -> int:
    from ._sync import progress_bar, progress_lines, sync
    from .policies import KeepEvery, KeepLast

    policies = ([KeepLast(args.keep_last)] if args.keep_last is not None else []) + \
        ([KeepEvery(args.keep_every)] if args.keep_every is not None else [])
    report = sync(args.src, args.dst, dedup=not args.plain, keep=policies or None,
                  dry_run=args.dry_run, storage_options=so,
                  dst_storage_options=(_options(args.dst_option, "--dst-option")
                                       if args.dst_option else None),
                  progress=(None if args.quiet or args.dry_run else
                            progress_bar() if _is_tty(sys.stderr) else progress_lines()))
    verb = "would copy" if args.dry_run else "copied"
    for step in report.copied:
        print(f"{verb} step {step}")
    for step in report.conflicts:
        print(f"step {step}: another checkpoint under {args.dst}; left as it is")
    for step in report.healed:
        print(f"step {step}: was broken under {args.dst}; copied again")
    for step in report.broken:
        print(f"BROKEN step {step} under {args.dst}: {report.problems.get(step, '')}")
    for step in report.deleted:
        print(f"{'would delete' if args.dry_run else 'deleted'} step {step} under {args.dst}")
    if report.skipped:
        print(f"not copied (the retention would not keep them): step(s) "
              f"{', '.join(map(str, report.skipped))}")
    print(f"{len(report.copied)} step(s) {verb}, {len(report.present)} already there"
          + (f", {len(report.skipped)} left out by the retention" if report.skipped else "")
          + ("" if args.dry_run else f"; {_size(report.written)} written")
          + (f"; {len(report.broken)} broken" if report.broken else ""))
    return 1 if report.conflicts or report.broken else 0


def cmd_gc(args: argparse.Namespace, so: dict) -> int:
    # Takes the root's writer lock: refused (LockedError, naming the holder) while a run writes.
    removed = gc(args.root, grace=args.grace, storage_options=so)
    for url in removed:
        print(f"removed {url}")
    young = _young_leftovers(Store(args.root, dict(so)))
    grace = check_grace(args.grace)
    print(f"{len(removed)} leftover(s) removed under {args.root}"
          + (f"; {len(young)} kept, younger than the grace ({grace:g} s): `ckpt gc {args.root} "
             "--grace 0` removes them when no save is running" if young else ""))
    for url in young:
        log.info("gc: kept %s (younger than the grace)", url)
    return 0


def _young_leftovers(root: Store) -> list[str]:
    """What ``gc`` left that it would remove once old enough (it just removed the older ones):
    temporary folders of saves, step folders without a manifest, shards a committed manifest
    does not name.  (Unreferenced blobs of a backup root are not counted.)"""
    from ._commit import TMP_MARK
    from .layout import STEP

    root.fs.invalidate_cache()
    found = []
    for e in root.listdir():
        if e.is_link:
            continue
        child = root.child(e.name)
        if TMP_MARK in e.name or (STEP.fullmatch(e.name) and not child.exists(MANIFEST_NAME)):
            found.append(child.url)
        elif STEP.fullmatch(e.name):
            try:
                named = {sh.path for sh in api.read_manifest(child).shards}
            except CheckpointError:
                continue
            found += [child.join(f.name) for f in child.listdir()
                      if f.name.startswith("shard-") and f.name not in named and not f.is_link]
    return found


# -- the registry's verbs: import, export, convert, demo ----------------------------------------
# Their choices come from the installed adapters (each declares its native file formats), read
# only when one of these verbs runs: ``ckpt inspect`` must not import every adapter.
FORMAT_VERBS = ("import", "export", "convert")
# Options of the verbs themselves; a format option of the same name would shadow one.
_OWN_OPTIONS = {"from", "to", "model", "overwrite", "approximate", "help", "h", "root", "framework",
                "storage-option", "o", "json", "grace", "strict", "no-strict", "verbose", "v"}


class _MissingFramework(Exception):
    """A format or conversion needs a framework that is not installed (one line, exit 2)."""


def installed_formats() -> list[FileFormat]:
    """Every file format the installed adapters declare, in adapter then declaration order.

    An adapter whose ``formats`` cannot be read (its module fails to import) offers none: logged,
    never fatal, so one broken adapter leaves the others' formats usable.
    """
    found: dict[str, FileFormat] = {}
    for name in registry.available_adapters():
        try:
            formats = list(registry.get_adapter(name).formats)
        except Exception as e:  # noqa: BLE001 - a broken adapter offers nothing; the rest still work
            log.warning("ckpt: the %r adapter's file formats are unavailable (%s: %s)",
                        name, type(e).__name__, e)
            continue
        for fmt in formats:
            if not isinstance(fmt, FileFormat):
                log.warning("ckpt: the %r adapter declares a format that is not a FileFormat: %r",
                            name, fmt)
            elif fmt.name in found:
                log.warning("ckpt: format %r of the %r adapter is already declared by %r; ignored",
                            fmt.name, name, found[fmt.name].framework)
            else:
                found[fmt.name] = fmt
    return list(found.values())


def _verb(argv: Sequence[str]) -> str | None:
    """The verb of a command line (the first word that is not a global option or its value)."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word in ("-o", "--storage-option"):
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def _dest(option: str) -> str:
    return "format_option_" + option.replace("-", "_")


def _add_format_options(s: argparse.ArgumentParser, formats: Sequence[FileFormat]) -> None:
    """Each format's extra options (``FileFormat.options``) as ``--NAME VALUE``."""
    helps: dict[str, list[str]] = {}
    for fmt in formats:
        for option, text in fmt.options.items():
            if (option in _OWN_OPTIONS or option.replace("_", "-") in _OWN_OPTIONS
                    or not option.replace("-", "_").isidentifier()):
                log.warning("ckpt: option %r of format %r is not usable on the command line; "
                            "ignored", option, fmt.name)
                continue
            helps.setdefault(option, []).append(f"{fmt.name}: {text}")
    for option, texts in helps.items():
        # shown as --unique-id UNIQUE_ID; the keyword's own spelling (--unique_id) is accepted too
        shown = option.replace("_", "-")
        metavar = option.replace("-", "_").upper()
        s.add_argument(f"--{shown}", dest=_dest(option), default=None, metavar=metavar,
                       help="; ".join(texts))
        if shown != option:
            s.add_argument(f"--{option}", dest=_dest(option), default=None, metavar=metavar,
                           help=argparse.SUPPRESS)


def _format_kwargs(args: argparse.Namespace, fmt: FileFormat, formats: Sequence[FileFormat]) -> dict:
    """The chosen format's options as keywords (None when not given); refuses another format's."""
    known = {o for f in formats for o in f.options}
    stray = [o for o in known - set(fmt.options) if getattr(args, _dest(o), None) is not None]
    if stray:
        raise ValueError(f"--{', --'.join(sorted(stray))} does not apply to format {fmt.name!r}")
    return {o.replace("-", "_"): getattr(args, _dest(o), None) for o in fmt.options}


def _choices(names: Sequence[str]) -> dict:
    # argparse refuses every value of an empty choices list with an unhelpful message; the verb
    # explains instead (no adapter offers anything).
    return {"choices": list(names)} if names else {}


def _add_global_options(p: argparse.ArgumentParser, so_dest: str, verbose_dest: str) -> None:
    """``-o`` and ``-v``: accepted before the verb and after it.  The verb's parser stores them
    under other names (a subparser's defaults would otherwise overwrite what came before the verb);
    :func:`main` merges both."""
    p.add_argument("--storage-option", "-o", dest=so_dest, action="append", metavar="KEY=VALUE",
                   default=None if so_dest == "storage_option" else argparse.SUPPRESS,
                   help="fsspec storage option (repeatable; dots nest: client_kwargs.endpoint_url=...)")
    p.add_argument("--verbose", "-v", dest=verbose_dest, action="count",
                   default=0 if verbose_dest == "verbose" else argparse.SUPPRESS,
                   help="show ckptcore's log on stderr (-vv: debug detail too)")


class _GlobalSubparsers:
    """``add_parser`` that gives every verb the global options too."""

    def __init__(self, sub: Any):
        self._sub = sub

    def add_parser(self, *args: Any, **kwargs: Any) -> argparse.ArgumentParser:
        s = self._sub.add_parser(*args, **kwargs)
        _add_global_options(s, "storage_option_after", "verbose_after")
        return s


def _strict_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--strict", action=argparse.BooleanOptionalAction, default=None,
                   help="passed to the format's reader/writer (and the conversion) as strict=; "
                        "--no-strict restores what fits and skips the rest (e.g. a Dropout "
                        "model's seed generator); default: the format's own")


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; the registry's choices are filled in only when ``verb`` needs them."""
    p = argparse.ArgumentParser(prog="ckpt", description="Inspect, verify and compare ckptcore checkpoints.")
    _add_global_options(p, "storage_option", "verbose")
    p.add_argument("--version", action="version", version=f"ckpt (ckptcore) {__version__}")
    sub = _GlobalSubparsers(p.add_subparsers(dest="verb", required=True))
    _add_checkpoint_verbs(sub)
    _add_root_verbs(sub)

    formats = installed_formats() if verb in FORMAT_VERBS else []
    adapters = registry.available_adapters() if verb in ("convert", "demo") else []
    _add_file_verbs(sub, formats)
    _add_convert_verb(sub, formats, adapters)

    s = sub.add_parser("demo", help="train a tiny model, SIGKILL it mid-epoch, resume, compare")
    s.add_argument("--root", default=None, help="where checkpoints go (any fsspec URL; default: a temp folder)")
    s.add_argument("--framework", default=None, metavar="ADAPTER", **_choices(adapters),
                   help=f"whose demo model to train (installed: {', '.join(adapters) or 'none'}; "
                        "default: the reference one)")
    s.set_defaults(fn=cmd_demo)
    return p


def _add_checkpoint_verbs(sub: _GlobalSubparsers) -> None:
    """The verbs over one or two checkpoints: inspect, verify, diff."""
    s = sub.add_parser("inspect", help="show a checkpoint's contents from its manifest")
    s.add_argument("url")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("verify", help="check every checksum; exit 1 names each bad tensor, "
                                      "exit 2 when the checkpoint cannot be read at all")
    s.add_argument("url")
    s.add_argument("--deep", action="store_true",
                   help="URL is a root: hash every blob of a backup root against its name and "
                        "check every replica's blobs (a plain root: verify every step); exit 1 "
                        "if anything is still broken")
    s.add_argument("--repair-from", action="append", metavar="URL",
                   help="with --deep: repair damaged or missing blobs from this root (another "
                        "backup root, or the run's local root holding the same steps); repeatable")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("diff", help="which tensors differ between two checkpoints, and by how much "
                                    "(compares checksums; reads only tensors that differ)")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--keys", metavar="SECTION[,SECTION...]",
                   help="compare only these sections' tensors, e.g. model,optimizer "
                        "(default: every section)")
    s.set_defaults(fn=cmd_diff)


def _add_root_verbs(sub: _GlobalSubparsers) -> None:
    """The verbs over a manager's root: ls, sync, gc."""
    s = sub.add_parser("ls", help="list the committed checkpoints under a manager's root")
    s.add_argument("root")
    s.add_argument("--backup", metavar="URL", help="a backup root too: show which tiers hold each step")
    s.add_argument("--json", action="store_true",
                   help="a JSON list, one object per step: step (the folder's), folder, url, "
                        "saved_step, epoch, framework, bytes, created (Unix time), metrics, tiers "
                        "(problem instead of the manifest's fields when it cannot be read)")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("sync", help="copy the committed checkpoints of one root to another "
                                    "(any two stores), incremental and resumable")
    s.add_argument("src", help="the root to copy from (a manager's root)")
    s.add_argument("dst", help="the root to copy to")
    s.add_argument("--plain", action="store_true",
                   help="write plain copies (default: deduplicated blobs shared between steps)")
    s.add_argument("--dry-run", action="store_true", help="only say what would be copied and deleted")
    s.add_argument("--keep-last", type=int, metavar="N", help="then keep only the newest N steps in DST")
    s.add_argument("--keep-every", type=int, metavar="K",
                   help="then keep every step divisible by K in DST (with --keep-last: either)")
    s.add_argument("--dst-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option for DST only (default: the -o options)")
    s.add_argument("--quiet", "-q", action="store_true",
                   help="no progress on stderr (a bar on a terminal, else a line per step copied)")
    s.set_defaults(fn=cmd_sync)
    s = sub.add_parser("gc", help="remove leftovers of interrupted saves under a manager's root")
    s.add_argument("root")
    s.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                   help="only leftovers untouched this long (default: 900, or CKPTCORE_GC_GRACE)")
    s.set_defaults(fn=cmd_gc)


# --model's help, shared by import, export and convert
_MODEL_HELP = ("MODULE:FACTORY; FACTORY() returns a model, (model, optimizer, ...) or a dict of "
               "keyword objects; the live objects name or shape the tensors")


def _add_file_verbs(sub: _GlobalSubparsers, formats: list[FileFormat]) -> None:
    """import and export, whose --from/--to choices are the installed ``formats``."""
    readable = [f.name for f in formats if f.read is not None]
    writable = [f.name for f in formats if f.write is not None]
    s = sub.add_parser("import", help="turn another framework's native checkpoint files into a "
                                      "ckptcore checkpoint (formats: see --from)")
    s.add_argument("src", help="the native checkpoint (its format is detected unless --from says)")
    s.add_argument("dst", help="where the ckptcore checkpoint goes (any fsspec URL)")
    s.add_argument("--from", dest="from_format", metavar="FORMAT", **_choices(readable),
                   help=f"the format of SRC (installed: {', '.join(readable) or 'none'})")
    s.add_argument("--model", metavar="MODULE:FACTORY", help=_MODEL_HELP)
    s.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint already at DST (default: refuse)")
    _strict_option(s)
    _add_format_options(s, [f for f in formats if f.read is not None])
    s.set_defaults(fn=cmd_import, formats=formats)

    s = sub.add_parser("export", help="write a ckptcore checkpoint as another framework's native files")
    s.add_argument("src", help="a ckptcore checkpoint URL")
    s.add_argument("dst", help="the file or prefix to write")
    s.add_argument("--to", required=True, metavar="FORMAT", **_choices(writable),
                   help=f"installed: {', '.join(writable) or 'none'}")
    s.add_argument("--model", metavar="MODULE:FACTORY", help=_MODEL_HELP)
    _strict_option(s)
    _add_format_options(s, [f for f in formats if f.write is not None])
    s.set_defaults(fn=cmd_export, formats=formats)


def _add_convert_verb(sub: _GlobalSubparsers, formats: list[FileFormat],
                      adapters: list[str]) -> None:
    """convert, whose --to is an installed adapter or a writable format."""
    writable = [f.name for f in formats if f.write is not None]
    s = sub.add_parser("convert", help="migrate a checkpoint to another framework's layout")
    s.add_argument("src", help="a ckptcore checkpoint URL")
    s.add_argument("dst", help="a ckptcore checkpoint URL, or a native file or prefix with --to FORMAT")
    s.add_argument("--to", required=True, metavar="ADAPTER|FORMAT", **_choices([*adapters, *writable]),
                   help=f"an adapter (installed: {', '.join(adapters) or 'none'}) or a file format "
                        f"(installed: {', '.join(writable) or 'none'})")
    s.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="builds the target objects (model, optimizer and any others the target "
                        "adapter captures) that give the target's structure; " + _MODEL_HELP)
    s.add_argument("--approximate", action="store_true",
                   help="convert what cannot continue exactly (schedules...) with a warning instead of failing")
    s.add_argument("--overwrite", action="store_true",
                   help="replace a ckptcore checkpoint already at DST (default: refuse)")
    _strict_option(s)
    _add_format_options(s, [f for f in formats if f.write is not None])
    s.set_defaults(fn=cmd_convert, formats=formats)


def load_factory(spec: str | None) -> dict[str, Any]:
    """Call ``module:factory`` (``module`` importable from the current folder) and return its
    objects as keywords: a model alone is ``{"model": ...}``, a tuple ``(model, optimizer,
    scheduler)`` (as long as it is), a mapping is taken as it is (it must hold ``model``)."""
    if not spec or ":" not in spec:
        raise ValueError(f"--model expects MODULE:FACTORY, e.g. mymodels:build; got {spec!r}")
    import importlib
    sys.path.insert(0, os.getcwd())
    module, _, attr = spec.partition(":")
    built = getattr(importlib.import_module(module), attr)()
    if isinstance(built, Mapping):
        if "model" not in built:
            raise ValueError(f"--model {spec}: the mapping it returned has no 'model'")
        return dict(built)
    if isinstance(built, (tuple, list)):
        if not 1 <= len(built) <= 3:
            raise ValueError(f"--model {spec}: returned {len(built)} objects; return (model, "
                             "optimizer, scheduler) or a dict of keyword objects")
        return {k: v for k, v in zip(("model", "optimizer", "scheduler"), built) if v is not None}
    return {"model": built}


@contextlib.contextmanager
def _needs(framework: str, what: str) -> Iterator[None]:
    """A missing framework module, while ``what`` runs, as one line with the registry's hint."""
    try:
        yield
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if not missing or missing.startswith("ckptcore"):
            raise  # one of our own modules is missing: a broken install, not a missing framework
        raise _MissingFramework(f"{what} needs {missing!r}, which is not installed; "
                                f"{registry.install_hint(framework)}") from None


def _pick(formats: Sequence[FileFormat], name: str | None, src: str) -> FileFormat:
    readable = [f for f in formats if f.read is not None]
    if name is not None:
        for f in readable:
            if f.name == name:
                return f
        raise LookupError(f"no installed ckptcore adapter reads the format {name!r} "
                          f"(installed: {', '.join(f.name for f in readable) or 'none'})")
    if not readable:
        raise LookupError("no installed ckptcore adapter offers a file format to import "
                          f"(installed adapters: {', '.join(registry.available_adapters()) or 'none'})")
    hits = []
    for f in readable:
        try:
            if f.detect(src):
                hits.append(f)
        except Exception as e:  # noqa: BLE001 - a detector that fails has not recognised the file
            log.warning("ckpt import: format %r could not examine %s (%s: %s)", f.name, src,
                        type(e).__name__, e)
    if len(hits) != 1:
        why = "matches none" if not hits else f"matches {', '.join(f.name for f in hits)}"
        raise ValueError(f"{src} {why} of the installed formats; pass --from FORMAT "
                         f"({', '.join(f.name for f in readable)})")
    log.info("ckpt import: %s detected as %s", src, hits[0].name)
    return hits[0]


def _shown(written: Any) -> str:
    if isinstance(written, (tuple, list)):
        return ", ".join(str(w) for w in written if w is not None)
    return str(written)


def _strict(args: argparse.Namespace) -> dict[str, bool]:
    """``strict=`` for a format's reader or writer, only when ``--strict/--no-strict`` was given
    (a format that does not take it then says so, rather than getting an option it never asked for)."""
    return {} if getattr(args, "strict", None) is None else {"strict": args.strict}


def _make_parent(dst: str) -> None:
    """Create the folder a native file or prefix ``dst`` goes into, when it is missing: format
    writers write plain files and expect their folder to exist."""
    path = dst[len("file://"):] if dst.startswith("file://") else dst
    if "://" in path:
        return  # a URL: object stores have no folders to create
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        log.info("ckpt: creating the folder %s for %s", parent, dst)
        os.makedirs(parent, exist_ok=True)


def cmd_import(args: argparse.Namespace, so: dict) -> int:
    fmt = _pick(args.formats, args.from_format, args.src)
    options = _format_kwargs(args, fmt, args.formats)
    with _needs(fmt.framework, f"format {fmt.name!r} (the {fmt.framework} adapter)"):
        objects = load_factory(args.model) if args.model else {}
        state = fmt.read(args.src, model=objects.get("model"), optimizer=objects.get("optimizer"),
                         **options, **_strict(args))
    info = api.save_state(args.dst, state, storage_options=so, overwrite=args.overwrite)
    print(f"imported {args.src} ({fmt.name}) -> {info.url} ({len(info.tensors)} tensors, "
          f"{_size(info.nbytes)})")
    return 0


def _writer(formats: Sequence[FileFormat], name: str) -> FileFormat:
    for f in formats:
        if f.name == name and f.write is not None:
            return f
    raise LookupError(f"no installed ckptcore adapter writes the format {name!r} "
                      f"(installed: {', '.join(f.name for f in formats if f.write) or 'none'})")


def cmd_export(args: argparse.Namespace, so: dict) -> int:
    fmt = _writer(args.formats, args.to)
    options = _format_kwargs(args, fmt, args.formats)
    if fmt.needs_model and not args.model:
        raise ValueError(f"--to {fmt.name} needs --model MODULE:FACTORY: the live objects name "
                         "the files' entries")
    state = api.load_state(args.src, storage_options=so)
    with _needs(fmt.framework, f"format {fmt.name!r} (the {fmt.framework} adapter)"):
        objects = load_factory(args.model) if args.model else {}
        _make_parent(args.dst)
        written = fmt.write(state, args.dst, model=objects.get("model"),
                            optimizer=objects.get("optimizer"), **options, **_strict(args))
    print(f"exported {args.src} -> {_shown(written)}")
    return 0


def cmd_convert(args: argparse.Namespace, so: dict) -> int:
    import warnings

    adapters = registry.available_adapters()
    fmt = None if args.to in adapters else _writer(args.formats, args.to)
    target = args.to if fmt is None else fmt.framework
    options = _format_kwargs(args, fmt, args.formats) if fmt is not None else {}
    if fmt is None and args.strict is not None:
        raise ValueError(f"--strict/--no-strict applies to a file format's writer; converting to "
                         f"the {args.to!r} adapter restores nothing (the conversion is always "
                         "checked whole)")
    with _needs(target, f"converting to {args.to!r}"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        objects = load_factory(args.model)
        model, optimizer = objects.pop("model"), objects.pop("optimizer", None)
        state = api.convert(args.src, target, model, optimizer, approximate=args.approximate,
                            storage_options=so, **objects)
        if fmt is not None:
            _make_parent(args.dst)
            written = _shown(fmt.write(state, args.dst, model=model, optimizer=optimizer, **options,
                                       **_strict(args)))
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if fmt is None:
        written = api.save_state(args.dst, state, storage_options=so, overwrite=args.overwrite).url
    print(f"converted {args.src} ({state.metadata.get('migrated_from', {}).get('framework')}) -> "
          f"{written} ({target})")
    return 0


# The demo's workers inherit the environment: frameworks' own start-up chatter (TensorFlow's C++
# log, oneDNN notices, Paddle's glog) stays out of the demonstration's output.
_QUIET_FRAMEWORKS = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0",
                     "GLOG_minloglevel": "3", "FLAGS_call_stack_level": "0"}


def cmd_demo(args: argparse.Namespace, so: dict) -> int:
    from .demo import run_demo
    for key, value in _QUIET_FRAMEWORKS.items():
        os.environ.setdefault(key, value)  # a user's own setting wins
    if args.framework is None:
        return run_demo(args.root, storage_options=so)
    return run_demo(args.root, args.framework, so)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb.  Exit codes: 0 done (``verify``: intact), 1 differences or problems found
    (``verify``, ``diff``), 2 the input cannot be read, the arguments are wrong or a framework is
    not installed, 3 an internal error (a bug: reported in one line, with the traceback only when
    ``CKPT_TRACEBACK=1``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_verb(argv)).parse_args(argv)
    # -o and -v may come before the verb and after it: both count.
    pairs = (args.storage_option or []) + (getattr(args, "storage_option_after", None) or [])
    verbosity = args.verbose + getattr(args, "verbose_after", 0)
    try:
        with _logging_to_stderr(verbosity):
            rc = int(args.fn(args, _options(pairs)) or 0)
            sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return rc
    except BrokenPipeError as e:
        if _stdout_gone():
            return _pipe_closed()
        # a connection of the storage broke, not our reader: an error like any other
        print(f"ckpt {args.verb}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError, ValueError, TypeError, LookupError) as e:
        print(f"ckpt {args.verb}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except _MissingFramework as e:
        print(f"ckpt {args.verb}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a one-line report instead of a traceback
        if os.environ.get("CKPT_TRACEBACK") == "1":
            raise
        print(f"ckpt {args.verb}: internal error: {type(e).__name__}: {e} (please report it; "
              "CKPT_TRACEBACK=1 shows where)", file=sys.stderr)
        return 3


@contextlib.contextmanager
def _logging_to_stderr(verbosity: int) -> Iterator[None]:
    """With ``-v``, the ``ckptcore`` log (INFO; ``-vv``: DEBUG) on stderr for this command."""
    if verbosity <= 0:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ckpt: %(levelname)s %(message)s"))
    before = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(before)


# 128 + SIGPIPE: what a shell reports for a command whose reader went away (``ckpt ls | head``).
_EXIT_PIPE = 141


def _stdout_gone() -> bool:
    """Whether stdout's reader went away (its pipe reports an error), as opposed to a
    ``BrokenPipeError`` of some connection the verb used."""
    import select
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout (an in-process caller)
        return True


def _pipe_closed() -> int:
    """The reader of our stdout went away: stop quietly, like other command-line tools.

    Python's exit would flush stdout again and print "Exception ignored ... BrokenPipeError":
    point stdout at /dev/null first (the output has nowhere to go anyway)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (an in-process caller)
        pass
    return _EXIT_PIPE


if __name__ == "__main__":
    sys.exit(main())
