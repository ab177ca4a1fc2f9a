"""Two processes on 127.0.0.1, 4 CPU devices each: a psum across processes."""

import json
import os
import socket
import subprocess
import sys
import textwrap

TIMEOUT_S = 120

WORKER = textwrap.dedent("""
    import json, os, sys
    process_id, port = int(sys.argv[1]), int(sys.argv[2])
    import jax
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id,
                               initialization_timeout=60)
    import numpy as np
    from jaxworks.pmap_chunked import pmap

    f = pmap(lambda v, w: v + jax.lax.psum(v, "i") * w, "i",
             in_axes=(0, None))
    local = np.arange(4.0) + 4 * process_id      # this process's 4 slices
    out = f(local, np.float32(1.0))               # host-local in, global out
    again = f(out, np.float32(2.0))               # global array fed back
    gathered = pmap(lambda v: jax.lax.all_gather(v, "i"), "i")(local)
    shards = lambda a: {str(s.device.id): np.asarray(s.data).tolist()
                        for s in a.addressable_shards}
    print("RESULT " + json.dumps({
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "shape": list(out.shape),
        "spec": str(out.sharding.spec),
        "out": shards(out),
        "again": shards(again),
        "gathered": shards(gathered),
        "cache": [
          getattr(f.cache_info(), k)
          for k in ("hits", "misses", "entries", "evictions", "maxsize")
        ],
    }), flush=True)
    jax.distributed.shutdown()
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_psum_across_processes(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(WORKER)
  env = dict(os.environ)
  env.update(
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
  )
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, str(script), str(i), str(port)],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
      cwd=tmp_path,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=TIMEOUT_S)
      outputs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  results = []
  for i, (p, text) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} failed:\n{text[-3000:]}"
    line = next(l for l in text.splitlines() if l.startswith("RESULT "))
    results.append(json.loads(line[len("RESULT ") :]))

  # Each process passes different values (process p: 4p .. 4p + 3), so the
  # psum over all 8 devices (28) differs from either process's own sum (6 or
  # 22): only a psum across the processes gives it.
  total = sum(range(8))
  for pid, r in enumerate(results):
    assert r["process_count"] == 2 and r["device_count"] == 8
    assert r["shape"] == [8] and "'i'" in r["spec"]
    values = sorted(v for v in r["out"].values())
    assert values == [[4 * pid + k + total] for k in range(4)]
    second_total = sum(k + total for k in range(8))
    again = sorted(v for v in r["again"].values())
    assert again == [[4 * pid + k + total + 2 * second_total] for k in range(4)]
    assert r["cache"] == [
      1,
      1,
      1,
      0,
      256,
    ]  # hits, misses, entries, evicted, max
    # Every device of both processes sees all 8 slices in global order:
    # process p's slices sit at positions 4p .. 4p + 3.
    assert list(r["gathered"].values()) == [[list(map(float, range(8)))]] * 4
