"""What every results JSON records about the run: device, versions, commit, date. Notebooks load these files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import tempfile

import jax
import jaxlib
from absl import flags


def environment() -> dict:
  dev = jax.devices()[0]
  if os.environ.get("DS4JAX_GIT_COMMIT"):  # wins: a device machine's copy may carry a stale .git under new files
    commit, dirty = os.environ["DS4JAX_GIT_COMMIT"], None
  else:
    commit, dirty = _git_commit()
  return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              device_kind=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
              jax=jax.__version__, jaxlib=jaxlib.__version__, python=platform.python_version(),
              host=platform.node(), git_commit=commit, git_dirty=dirty)


def _git_commit() -> tuple[str, bool | None]:
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                            cwd=os.path.dirname(__file__)).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip())
  except (OSError, subprocess.CalledProcessError):  # a copy without git: set DS4JAX_GIT_COMMIT
    return "unknown", None
  return commit, dirty


def out_problem(path: str, directory: bool = False) -> str | None:
  """Why results cannot be written at `path` (a file, or with `directory` a folder), else None. Checked at start-up
  so that no run loses its results at the end. The writer makes missing folders, so this writes a scratch file in
  the nearest folder that exists (os.access says yes to root for places like /proc) and makes nothing."""
  if not directory and os.path.isdir(path):
    return "is a directory"
  if directory and os.path.exists(path) and not os.path.isdir(path):
    return "is a file, not a directory"
  where = os.path.abspath(path) if directory else os.path.dirname(os.path.abspath(path))
  while not os.path.exists(where):
    where = os.path.dirname(where)
  if not os.path.isdir(where):
    return f"{where} is not a directory"
  try:
    with tempfile.TemporaryFile(dir=where):
      pass
  except OSError as e:
    return f"cannot write in {where} ({e.strerror or e})"
  return None


def define_out_flag(name: str = "out", help_text: str = "Results JSON.", default: str | None = None,
                    directory: bool = False, flag_values: flags.FlagValues | None = None):
  """--out (or `name`): where results go, checked when the flags are parsed (out_problem), so a bad path
  fails at start-up in one line, not after the run."""
  fv = flags.FLAGS if flag_values is None else flag_values
  holder = flags.DEFINE_string(name, default, help_text, flag_values=fv)

  def writable(path):
    if path and (problem := out_problem(path, directory)):
      raise flags.ValidationError(problem)
    return True
  flags.register_validator(name, writable, flag_values=fv)
  return holder


def write_json(path: str, record: dict) -> None:
  """Writes atomically (temp file + rename), so a crash never leaves half a results file."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1, sort_keys=False)
  os.replace(tmp, path)


def appender(path: str | None, record: dict):
  """save(run): appends `run` to record["runs"], prints it and rewrites `path` (when given), so that a crash or a
  time-out loses nothing already measured."""
  def save(run: dict) -> None:
    record["runs"].append(run)
    print(run, flush=True)
    if path:
      write_json(path, record)
  return save


def peak_device_bytes() -> int | None:
  """Peak bytes in use on this process's first device (jax.devices() starts with process 0's, whose stats another
  process cannot read)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")
