"""The ``ckpt`` verbs that read checkpoints and a run's roots: ``inspect``, ``verify`` (and
``--deep``), ``diff``, ``ls``, ``log``, ``report`` (the page itself: :mod:`ckptcore.report`),
``sync`` and ``gc``, with their printing helpers (the tensor tree,
chunk spans, ls columns).

Separate from :mod:`ckptcore.cli`, which holds the parser and ``main`` and imports this module;
these verbs need no adapter and no framework, unlike those of :mod:`ckptcore._cli_files`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Any, Mapping

from . import api
from ._cli_common import Progress, is_tty, parse_options, size_text, usage_error
from ._diff import diff
from ._manifest import MANIFEST_NAME
from ._storage import Store
from .errors import CheckpointError, CheckpointNotFoundError
from .layout import check_grace, gc, is_root, list_checkpoints, recorded_backups
from ._runlog import lineage_lines, local_time, render, run_log

log = logging.getLogger("ckptcore")


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
    print(f"saved       {_when(info.created)}")
    for i, line in enumerate(lineage_lines(info.lineage)):
        print(f"{'lineage' if i == 0 else '':<11} {line}")
    if info.data:
        d = info.data
        print(f"data        epoch {d.get('epoch')} / position {d.get('position')} / seed {d.get('seed')}"
              + (f"  ({d.get('num_samples')} samples, batch {d.get('batch_size')})"
                 if "num_samples" in d else ""))
    n, chunks = _count(info)
    print(f"tensors     {n}{chunks} in {len(info.shards)} shard(s), {size_text(info.nbytes)}")
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
        size = size_text(sum(r.nbytes for r in rows))
        cut = _chunking(rows) if t.global_shape is not None else ""
        print(f"{text:<{width}} {t.dtype:<10} {shape:<16} {size}" + (f"   {cut}" if cut else ""))


def cmd_verify(args: argparse.Namespace, so: dict) -> int:
    if args.deep:
        return _verify_deep(args, so)
    if args.repair_from:
        raise ValueError("--repair-from needs --deep (it repairs a scrubbed root)")
    info = _inspect(args.url, so)
    with Progress(info.nbytes, "verifying"):
        problems = api.verify(args.url, storage_options=so)
    for p in problems:
        print(f"BAD  {p}")
    if problems:
        print(f"{args.url}: {len(problems)} problem(s)")
        return 1
    n, chunks = _count(info)
    print(f"{args.url}: OK ({n} tensors{chunks}, every chunk checked, {size_text(info.nbytes)})"
          if chunks else f"{args.url}: OK ({n} tensors, {size_text(info.nbytes)})")
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
    print(f"{args.url}: {what}, {size_text(report.bytes_read)} read: {len(report.damaged)} damaged, "
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


RECORDED = "recorded"  # --backup recorded: the backup roots the root's writer named


def _backups(root: str, given: Any, so: dict) -> list[str]:
    """The ``--backup`` URLs of ``ls``/``log``/``report``: ``recorded`` stands for the backup
    roots the root's newest writer named in its record (``_fence``).  Without ``--backup``,
    those are named on stderr, not read: a root may come from anywhere, so the URLs it names are
    read only when the user asks for them."""
    urls = [given] if isinstance(given, str) else list(given or [])
    if RECORDED in urls and not Store(root, dict(so)).exists():
        raise FileNotFoundError(f"{root} does not exist (no such folder or bucket), so it names "
                                f"no backup for --backup {RECORDED}")
    named = recorded_backups(root, storage_options=so) if (not urls or RECORDED in urls) else []
    if RECORDED in urls:
        if not named:
            raise usage_error(f"--backup {RECORDED}: {root} names no backup root (its writer had "
                              "no backup=, or is older than that record); pass the backup's URL")
        print(f"(--backup {RECORDED}: {', '.join(named)})", file=sys.stderr)
        urls = [u for x in urls for u in (named if x == RECORDED else [x])]
        return list(dict.fromkeys(urls))
    if named:
        print(f"({root}'s writer replicates to {', '.join(named)}; add --backup {RECORDED} to "
              "include that tier)", file=sys.stderr)
    return urls


def cmd_ls(args: argparse.Namespace, so: dict) -> int:
    store = Store(args.root, dict(so))
    backups = _backups(args.root, args.backup, so)
    if len(backups) > 1:
        print(f"(listing the first backup root, {backups[0]}; `ckpt log` takes them all)",
              file=sys.stderr)
    args.backup = backups[0] if backups else None
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
                lin = info.lineage or {}
                row.update(saved_step=info.step, epoch=_epoch(info), framework=info.framework,
                           bytes=info.nbytes, created=info.created,
                           created_local=local_time(info.created), metrics=metrics,
                           run_id=lin.get("run_id"), resume_count=lin.get("resume_count"))
            row["tiers"] = [t for t, d in (("local", local), ("backup", backup)) if step in d]
            rows.append(row)
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if (local or backup) and is_tty(sys.stdout):
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
              f"{info.framework or '-':<9} {size_text(info.nbytes):>10}  {_when(info.created)}  "
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


def cmd_log(args: argparse.Namespace, so: dict) -> int:
    args.backup = _backups(args.root, args.backup, so)
    _run_root(args.root, args.backup, so)
    data = run_log(args.root, backups=args.backup or (), storage_options=so)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    if not (data["runs"] or data["unrecorded"] or data["unreadable"]):
        print(f"no committed checkpoints under {args.root}")
        return 0
    for line in render(data):
        print(line)
    return 0


def _run_root(root: str, backups: Any, so: dict) -> None:
    """A root ``ckpt log``/``ckpt report`` can read: it exists (or a backup is named) and is
    not one checkpoint's folder."""
    store = Store(root, dict(so))
    if not store.exists() and not backups:  # a typo or a missing bucket is not an empty run
        raise FileNotFoundError(f"{root} does not exist (no such folder or bucket)")
    if store.exists(MANIFEST_NAME) and not is_root(store):
        raise CheckpointNotFoundError(
            f"{root} is one checkpoint, not a run's root (a CheckpointManager folder): "
            f"`ckpt inspect {root}` shows its lineage")


def cmd_report(args: argparse.Namespace, so: dict) -> int:
    from .report import write_report

    out = args.output
    if "=" in os.path.basename(out) and not out.lower().endswith((".html", ".htm")):
        raise usage_error(f"ckpt report: -o/--output names the page to write, got {out!r}; "
                          "after `report`, storage options go in --storage-option KEY=VALUE "
                          "(or -o KEY=VALUE before the verb)")
    args.backup = _backups(args.root, args.backup, so)
    _run_root(args.root, args.backup, so)
    data = write_report(args.root, out, backups=args.backup or (), storage_options=so)
    runs = data["log"]["runs"]
    steps = sum(len(s["steps"]) for s in data["sessions"]) + len(data["log"]["unreadable"])
    bad = sum(1 for sev, _ in data["findings"] if sev == "bad")
    if not steps:
        print(f"{out}: no committed checkpoints under {args.root}")
        return 0
    print(f"{out}: {steps} step(s), {len(runs)} run(s), "
          f"{sum(r['resumes'] for r in runs)} resume(s); "
          + (f"{bad} PROBLEM(S) (see the page's verdict)" if bad else
             "warnings on the page" if data["status"] == "warn" else "nothing flagged"))
    return 0


def cmd_sync(args: argparse.Namespace, so: dict) -> int:
    from ._sync import progress_bar, progress_lines, sync
    from .policies import KeepEvery, KeepLast

    policies = ([KeepLast(args.keep_last)] if args.keep_last is not None else []) + \
        ([KeepEvery(args.keep_every)] if args.keep_every is not None else [])
    report = sync(args.src, args.dst, dedup=not args.plain, keep=policies or None,
                  dry_run=args.dry_run, storage_options=so,
                  dst_storage_options=(parse_options(args.dst_option, "--dst-option")
                                       if args.dst_option else None),
                  progress=(None if args.quiet or args.dry_run else
                            progress_bar() if is_tty(sys.stderr) else progress_lines()))
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
          + ("" if args.dry_run else f"; {size_text(report.written)} written")
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
    from ._commit import TMP_MARK, is_shard_file, shard_files
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
                named = set(api.read_manifest(child).files())
            except CheckpointError:
                continue
            found += [child.join(f.name) for f in shard_files(child)
                      if is_shard_file(f.name) and f.name not in named and not f.is_link]
    return found
