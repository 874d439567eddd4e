#!/usr/bin/env bash
# Idempotent set-up: a venv in .venv, torch (only when missing), the Python
# requirements, the package itself (editable) and the Debian packages that the
# synthetic corpus needs. A second run only checks, in seconds.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
DEB_PACKAGES=(espeak-ng flite sox fortune-mod fortunes)

log() { echo "$(date '+%Y-%m-%d %H:%M:%S') (setup) $*"; }

# 1. Debian packages (espeak-ng/flite: voices; sox: resampling and FLAC;
#    fortune-mod + fortunes: text).
missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "Debian packages present: ${DEB_PACKAGES[*]}"
fi

# 2. The virtual environment.
if [ ! -x "$PY" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi

# 3. torch: only when the venv has none, so a user's CUDA build is kept.
if ! "$PY" -c "import torch" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION"
  "$PY" -m pip install -q "torch==$TORCH_VERSION" 2>&1 | { grep -v "^WARNING: Location" || true; }
else
  log "torch present: $("$PY" -c 'import torch; print(torch.__version__)')"
fi

# 4. Requirements and the package (editable). Re-run only when the files change.
stamp="$VENV/.icefall-lite-requirements"
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "installing requirements.txt and the package (editable)"
  # pip warns about every absent local index folder: keep those out of the log.
  "$PY" -m pip install -q -r requirements.txt 2>&1 | { grep -v "^WARNING: Location" || true; }
  "$PY" -m pip install -q --no-deps -e . 2>&1 | { grep -v "^WARNING: Location" || true; }
  echo "$want" > "$stamp"
else
  log "requirements up to date"
fi
log "done"
