"""The ``ckpt`` verbs over other frameworks' native files and conversion: ``import``,
``export``, ``convert`` and ``demo``, with what they need: the installed file formats, the
``--model MODULE:FACTORY`` loader, format detection and each format's own options.

Separate from :mod:`ckptcore.cli`, which holds the parser and ``main`` and imports this module:
these verbs take their choices from the adapter registry (each adapter declares its formats and
its demo model), read only when one of them runs, and this module names no framework.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any, Iterator, Mapping, Sequence

from . import api, lineage, registry
from ._cli_common import size_text
from .adapter import FileFormat

log = logging.getLogger("ckptcore")


class MissingFramework(Exception):
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



def format_dest(option: str) -> str:
    """The argparse ``dest`` of a format's option: ``unique-id`` -> ``format_option_unique_id``."""
    return "format_option_" + option.replace("-", "_")


def format_kwargs(args: argparse.Namespace, fmt: FileFormat, formats: Sequence[FileFormat]) -> dict:
    """The chosen format's options as keywords (None when not given); refuses another format's."""
    known = {o for f in formats for o in f.options}
    stray = [o for o in known - set(fmt.options) if getattr(args, format_dest(o), None) is not None]
    if stray:
        raise ValueError(f"--{', --'.join(sorted(stray))} does not apply to format {fmt.name!r}")
    return {o.replace("-", "_"): getattr(args, format_dest(o), None) for o in fmt.options}


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
        raise MissingFramework(f"{what} needs {missing!r}, which is not installed; "
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
    options = format_kwargs(args, fmt, args.formats)
    with _needs(fmt.framework, f"format {fmt.name!r} (the {fmt.framework} adapter)"):
        objects = load_factory(args.model) if args.model else {}
        state = fmt.read(args.src, model=objects.get("model"), optimizer=objects.get("optimizer"),
                         **options, **_strict(args))
    info = api.save_state(args.dst, state, storage_options=so, overwrite=args.overwrite,
                          lineage=lineage.converted(framework=fmt.framework, format=fmt.name,
                                                    root=args.src))
    print(f"imported {args.src} ({fmt.name}) -> {info.url} ({len(info.tensors)} tensors, "
          f"{size_text(info.nbytes)})")
    return 0


def _writer(formats: Sequence[FileFormat], name: str) -> FileFormat:
    for f in formats:
        if f.name == name and f.write is not None:
            return f
    raise LookupError(f"no installed ckptcore adapter writes the format {name!r} "
                      f"(installed: {', '.join(f.name for f in formats if f.write) or 'none'})")


def cmd_export(args: argparse.Namespace, so: dict) -> int:
    fmt = _writer(args.formats, args.to)
    options = format_kwargs(args, fmt, args.formats)
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
    options = format_kwargs(args, fmt, args.formats) if fmt is not None else {}
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
        source = api.inspect(args.src, storage_options=so)
        run = lineage.converted(framework=source.framework, format="ckptcore", root=args.src,
                                source=source.lineage)
        written = api.save_state(args.dst, state, storage_options=so, overwrite=args.overwrite,
                                 lineage=run).url
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
