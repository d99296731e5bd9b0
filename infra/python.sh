# Sourced by infra/*.sh: PY is the project's interpreter (the .venv that `make setup` makes, else python3, unless PY
# names one), and its scripts folder (prefect, mlflow, opd-...) comes first on PATH, so those commands are its own.
_opd_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PY:-}" ]]; then
  if [[ -x "$_opd_root/.venv/bin/python" ]]; then PY="$_opd_root/.venv/bin/python"; else PY=python3; fi
fi
_opd_scripts="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null)" &&
  [[ -d "$_opd_scripts" ]] && PATH="$_opd_scripts:$PATH"
export PY PATH
