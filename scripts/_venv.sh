# Sourced by the other scripts: create .venv if missing and install ckptcore with the given extras.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -m pip install -q -e ".[$1]"
