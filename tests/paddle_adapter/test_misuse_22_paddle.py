"""Misuse a new user hit with the Paddle adapter: ckptcore's log lines in Paddle's format.

Importing paddle gives the root logger a handler with Paddle's format (and level INFO) unless
logging was set up before.  ckptcore's records propagate to the root, so they were printed as
``[time] [ WARNING] file.py:NN - message``, INFO records included, and a warning that ckptcore
also logs (``warn_and_log``) showed twice.  Now a ckptcore WARNING after importing paddle shows
once, as Python shows it when logging is not set up (the message alone), or once in the user's
own format when they set logging up; Paddle's handler still formats everyone else's records.

Each case runs in a process of its own: importing paddle changes the process's logging.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("paddle")

CAPTURE = textwrap.dedent('''
    import io, logging, sys, warnings
    err = io.StringIO()
    sys.stderr = err  # before paddle is imported: its root handler writes here too
    warnings.simplefilter("always")
''')

PROBES = textwrap.dedent('''
    from ckptcore.adapter import warn_and_log
    log = logging.getLogger("ckptcore")
    log.warning("probe-warning %s", "ok")
    log.info("probe-info")
    logging.getLogger("someone.else").warning("probe-other")
    warn_and_log("probe-both", UserWarning, stacklevel=1)
    sys.stdout.write(err.getvalue())
''')

CASES = {
    # import paddle first, configure nothing
    "unconfigured": "import paddle\nimport ckptcore_paddle\n",
    # ckptcore_paddle first: the shield is put up when the adapter first imports paddle
    "adapter_first": "import ckptcore_paddle\nimport paddle\nckptcore_paddle.Checkpoint\n",
    # the user's own logging, set up after paddle (force=True: paddle's root handler is there)
    "basicConfig": ("import paddle\nimport ckptcore_paddle\nlogging.basicConfig(format='USER|%(name)s|"
                    "%(levelname)s|%(message)s', level=logging.INFO, force=True)\n"),
    # set up before paddle: paddle adds no root handler
    "basicConfig_first": ("logging.basicConfig(format='USER|%(name)s|%(levelname)s|%(message)s', "
                          "level=logging.INFO)\nimport paddle\nimport ckptcore_paddle\n"),
}


def _lines(out: str, word: str) -> list[str]:
    return [line for line in out.splitlines() if word in line]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_ckptcore_warning_after_importing_paddle_shows_once_in_the_standard_format(
        tmp_path, run_python, case):
    script = tmp_path / "probe.py"
    script.write_text(CAPTURE + CASES[case] + PROBES)
    out = run_python(script, timeout=600)
    user = case.startswith("basicConfig")
    warning = _lines(out, "probe-warning")
    assert warning == (["USER|ckptcore|WARNING|probe-warning ok"] if user else ["probe-warning ok"]), out
    assert _lines(out, "probe-info") == (["USER|ckptcore|INFO|probe-info"] if user else []), out
    # Without logging set up: the Python warning only; with it: the user's log line and the warning.
    assert len(_lines(out, "UserWarning: probe-both")) == 1, out
    logged = [line for line in _lines(out, "probe-both")
              if "UserWarning" not in line and "warn_and_log(" not in line]
    assert logged == (["USER|ckptcore|WARNING|probe-both"] if user else []), out
    other = _lines(out, "probe-other")
    assert len(other) == 1, out
    if case in ("unconfigured", "adapter_first"):
        assert other[0].startswith("[") and "WARNING]" in other[0], out  # Paddle's own format, kept
