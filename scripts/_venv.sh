# Sourced by the other scripts: create .venv if missing and install ckptcore with the given extras.
# The install runs once, and again only when pyproject.toml or the extras changed since (a stamp
# in .venv records what was installed; deleting .venv starts over).  pip and the build backend
# are quiet; their output is shown only when the install fails.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
fi
# PyTorch: exactly torch==2.13.0 (a CPU build this machine's package index holds), installed before
# the extras so that the [torch] (or [bench]) extra's range is met by it; a plain `torch`
# requirement with no torch installed would download a CUDA build of several GB.
if [[ ",$1," == *",torch,"* || ",$1," == *",bench,"* ]] \
    && ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "installing torch==2.13.0 (CPU) into .venv (once)..." >&2
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 \
      >.venv/.torch-install.log 2>&1; then
    cat .venv/.torch-install.log >&2
    echo "installing torch==2.13.0 failed (the log above is in .venv/.torch-install.log)" >&2
    exit 1
  fi
fi
_ckpt_stamp=".venv/.ckptcore-installed"
_ckpt_want="extras=$1 pyproject=$(cksum < pyproject.toml)"
if [ ! -f "$_ckpt_stamp" ] || [ "$(cat "$_ckpt_stamp")" != "$_ckpt_want" ]; then
  _ckpt_log=".venv/.ckptcore-install.log"
  echo "installing ckptcore into .venv (once; again only when pyproject.toml changes)..." >&2
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$1]" >"$_ckpt_log" 2>&1; then
    cat "$_ckpt_log" >&2
    echo "installing ckptcore into .venv failed (the log above is in $_ckpt_log)" >&2
    exit 1
  fi
  printf '%s\n' "$_ckpt_want" > "$_ckpt_stamp"
fi
