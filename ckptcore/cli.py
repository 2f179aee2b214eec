"""``ckpt``: thin verbs over the public API.  No logic lives here, and no framework is needed.

This module holds the parser and :func:`main`; the verbs live in :mod:`ckptcore._cli_read`
(inspect, verify, diff, ls, log, report, sync, gc) and :mod:`ckptcore._cli_files` (import, export, convert,
demo), over the helpers they share in :mod:`ckptcore._cli_common`.

The verbs that touch other frameworks (``import``, ``export``, ``convert``, ``demo``) take their
choices from the adapter registry: each adapter declares its native file formats
(:class:`~ckptcore.adapter.FileFormat`) and its demo model; this module names no framework.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any, Iterator, Sequence

from . import registry
from ._cli_common import parse_options
from ._cli_files import (MissingFramework, cmd_convert, cmd_demo, cmd_export, cmd_import,
                         format_dest, format_kwargs, installed_formats, load_factory)
from ._cli_read import (cmd_diff, cmd_gc, cmd_inspect, cmd_log, cmd_ls, cmd_report, cmd_sync,
                        cmd_verify)
from ._version import __version__
from .adapter import FileFormat
from .errors import CheckpointError

# Importable from here as before: the verbs, the formats the installed adapters declare and the
# --model loader (defined in the verb modules).
__all__ = ["FORMAT_VERBS", "build_parser", "cmd_convert", "cmd_demo", "cmd_diff", "cmd_export",
           "cmd_gc", "cmd_import", "cmd_inspect", "cmd_log", "cmd_ls", "cmd_report", "cmd_sync",
           "cmd_verify", "installed_formats", "load_factory", "main"]

log = logging.getLogger("ckptcore")


# The verbs whose choices come from the installed adapters (each declares its native file
# formats), read only when one of these verbs runs: ``ckpt inspect`` must not import every adapter.
FORMAT_VERBS = ("import", "export", "convert")
# Options of the verbs themselves; a format option of the same name would shadow one.
_OWN_OPTIONS = {"from", "to", "model", "overwrite", "approximate", "help", "h", "root", "framework",
                "storage-option", "o", "json", "grace", "strict", "no-strict", "verbose", "v"}


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
        s.add_argument(f"--{shown}", dest=format_dest(option), default=None, metavar=metavar,
                       help="; ".join(texts))
        if shown != option:
            s.add_argument(f"--{option}", dest=format_dest(option), default=None, metavar=metavar,
                           help=argparse.SUPPRESS)


# The chosen format's options as keywords; under its old name here (the verbs use it from
# ._cli_files, the parser's tests from here).
_format_kwargs = format_kwargs


def _choices(names: Sequence[str]) -> dict:
    # argparse refuses every value of an empty choices list with an unhelpful message; the verb
    # explains instead (no adapter offers anything).
    return {"choices": list(names)} if names else {}


def _add_global_options(p: argparse.ArgumentParser, so_dest: str, verbose_dest: str,
                        short_o: bool = True) -> None:
    """``-o`` and ``-v``: accepted before the verb and after it.  The verb's parser stores them
    under other names (a subparser's defaults would otherwise overwrite what came before the verb);
    :func:`main` merges both.  ``short_o=False``: the verb's ``-o`` is its own (``ckpt report
    ROOT -o report.html``, the issue's contract); ``--storage-option`` still works after it."""
    p.add_argument("--storage-option", *(["-o"] if short_o else []), dest=so_dest,
                   action="append", metavar="KEY=VALUE",
                   default=None if so_dest == "storage_option" else argparse.SUPPRESS,
                   help="fsspec storage option (repeatable; dots nest: client_kwargs.endpoint_url=...)")
    p.add_argument("--verbose", "-v", dest=verbose_dest, action="count",
                   default=0 if verbose_dest == "verbose" else argparse.SUPPRESS,
                   help="show ckptcore's log on stderr (-vv: debug detail too)")


class _GlobalSubparsers:
    """``add_parser`` that gives every verb the global options too."""

    def __init__(self, sub: Any):
        self._sub = sub

    def add_parser(self, *args: Any, own_o: bool = False, **kwargs: Any) -> argparse.ArgumentParser:
        s = self._sub.add_parser(*args, **kwargs)
        _add_global_options(s, "storage_option_after", "verbose_after", short_o=not own_o)
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
    """The verbs over a manager's root: ls, log, report, sync, gc."""
    s = sub.add_parser("ls", help="list the committed checkpoints under a manager's root")
    s.add_argument("root")
    s.add_argument("--backup", metavar="URL", help="a backup root too: show which tiers hold each step "
                   "(`recorded`: the one the root's writer named)")
    s.add_argument("--json", action="store_true",
                   help="a JSON list, one object per step: step (the folder's), folder, url, "
                        "saved_step, epoch, framework, bytes, created (Unix time), created_local "
                        "(local time, ISO 8601), metrics, run_id, resume_count, tiers "
                        "(problem instead of the manifest's fields when it cannot be read)")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("log", help="a run's history from its checkpoints' lineage: runs, "
                                   "resumes (exact or flagged, and why), rewinds, migrations, tiers")
    s.add_argument("root")
    s.add_argument("--backup", metavar="URL", action="append",
                   help="a backup root too (repeatable): its steps join the history "
                        "(`recorded`: those the root's writer named)")
    s.add_argument("--json", action="store_true",
                   help="the same as data: {root, tiers, runs: [{run_id, tags, steps, resumes, "
                        "flagged, sessions: [...]}], unrecorded, unreadable} (docs/FORMAT.md)")
    s.set_defaults(fn=cmd_log)
    s = sub.add_parser("report", own_o=True,
                       help="write one self-contained HTML page about a run: the verdict first "
                            "(flagged resumes, lagging backups), lineage, a timeline of the steps "
                            "per tier, save and restore times, bytes and deduplication, metrics "
                            "across resumes")
    s.add_argument("root")
    s.add_argument("-o", "--output", required=True, metavar="FILE.html",
                   help="the page to write (a local file, replaced whole); here -o is the "
                        "output: storage options go in --storage-option KEY=VALUE, or in -o "
                        "before the verb")
    s.add_argument("--backup", metavar="URL", action="append",
                   help="a backup root too (repeatable): its steps join the timeline, and its "
                        "deduplication is shown (`recorded`: those the root's writer named)")
    s.set_defaults(fn=cmd_report)
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
            rc = int(args.fn(args, parse_options(pairs)) or 0)
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
    except MissingFramework as e:
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
