"""Device time by kernel from a JAX profiler trace: the complete events (`ph` "X") of the device processes' stream
threads, summed by kernel name cut at its first dot (`loop_convert_fusion.12` and `loop_convert_fusion.7` are one
kernel)."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os


def device_threads(events: list[dict]) -> dict[tuple[int, int], str]:
  """(pid, tid) -> thread name of the threads that run kernels: the stream threads of every device process
  ("/device:GPU:0" ...); all threads of a device process if none is named after a stream."""
  processes = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  on_device = {key: name for key, name in threads.items() if processes.get(key[0], "").startswith("/device:")}
  streams = {key: name for key, name in on_device.items() if name.lower().startswith("stream")}
  return streams or on_device


def kernel_times(events: list[dict]) -> dict[str, dict]:
  """Kernel name (cut at its first dot) -> {"ms": summed duration, "count": launches}, on the device threads."""
  threads = device_threads(events)
  out: dict[str, dict] = collections.defaultdict(lambda: dict(ms=0.0, count=0))
  for e in events:
    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in threads:
      k = out[e["name"].split(".")[0]]
      k["ms"] += e["dur"] / 1e3
      k["count"] += 1
  return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def summary(kernels: dict[str, dict], top: int) -> dict:
  """The `top` kernels with their share of the total, the rest as 'other'."""
  total = sum(k["ms"] for k in kernels.values())
  rows = [dict(kernel=name, ms=round(k["ms"], 3), count=k["count"], share=round(k["ms"] / total, 4) if total else 0)
          for name, k in list(kernels.items())[:top]]
  rest = list(kernels.values())[top:]
  if rest:
    ms = sum(k["ms"] for k in rest)
    rows.append(dict(kernel="other", ms=round(ms, 3), count=sum(k["count"] for k in rest),
                     share=round(ms / total, 4) if total else 0))
  return dict(device_ms=round(total, 3), kernels=rows)


def read_trace(trace_dir: str) -> list[dict]:
  """The events of the Perfetto trace that `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` wrote."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if len(paths) != 1:
    raise RuntimeError(f"expected one *.trace.json.gz under {trace_dir}, found {paths}")
  with gzip.open(paths[0], "rt") as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace
