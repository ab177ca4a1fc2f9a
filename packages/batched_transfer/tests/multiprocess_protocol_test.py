"""The collective save's protocol under failures (jax.distributed on
127.0.0.1): a save that one process refuses before it began, a failure
injected at every step of the protocol on one process at a time, a leaf in
Fortran order, a process that dies. After each: no committed checkpoint
holds data of two saves, no process reports a save that does not exist,
and every process raised or none did."""

import json
import os
import textwrap

from multiprocess_util import numpy_read
from multiprocess_util import run_n
import numpy as np

SETUP = textwrap.dedent("""
    import json, os, sys, time
    process_id, port, base, nproc = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    process_id, nproc = int(process_id), int(nproc)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=nproc, process_id=process_id,
                               initialization_timeout=60)
    from jaxworks import batched_transfer as bt
    # Private: each step of a collective save, patched to fail.
    from jaxworks.batched_transfer._src.checkpoint import (
        api, commit, destination, hostvalue, multiprocess, pending, steps,
        writer)
    rows = NamedSharding(jax.make_mesh((jax.device_count(),), ("x",)), P("x"))
    T = 20.0  # barrier_timeout_s: nothing here should wait for it

    def tree(k):
      # Every element of "w" is k (its rows lie on every process): a
      # checkpoint holding the data of two saves shows two values. A global
      # array made with no collective (device_put's check is one).
      w = np.full((4 * jax.device_count(), 4), k, np.float32)
      return {"w": jax.make_array_from_callback(w.shape, rows, lambda i: w[i]),
              "n": np.arange(3, dtype=np.int32)}

    claims, outcomes = [], []

    def attempt(label, path, k, fn):
      # Runs a save; records whether it raised, and what it claims saved.
      t0 = time.monotonic()
      try:
        fn()
      except Exception as err:
        outcomes.append([label, type(err).__name__, str(err)[:400],
                         time.monotonic() - t0])
      else:
        outcomes.append([label, "ok", "", time.monotonic() - t0])
        claims.append([path, k])

    def finish():
      with open(f"{base}/out-{process_id}.json", "w") as f:
        json.dump({"claims": claims, "outcomes": outcomes}, f)
      print("WORKER-OK", process_id, flush=True)
""")

REFUSED = SETUP + textwrap.dedent("""
    def refused(k):
      # A tree whose key "x/y" cannot name a file, on process 1 only.
      t = tree(k)
      if process_id == 1:
        t["x/y"] = np.zeros(1, np.float32)
      return t

    attempt("save-refused", f"{base}/a", 1,
            lambda: bt.save(f"{base}/a", refused(1), barrier_timeout_s=T))
    attempt("save-next", f"{base}/b", 2,
            lambda: bt.save(f"{base}/b", tree(2), barrier_timeout_s=T))
    for blocking in (True, False):
      mgr = bt.CheckpointManager(f"{base}/run-{blocking}",
                                 barrier_timeout_s=T)
      for step in range(1, 6):
        def save(step=step):
          mgr.save(step, refused(step) if step == 1 else tree(step),
                   blocking=blocking)
          mgr.wait_until_finished()
        attempt(f"step-{blocking}-{step}", f"{base}/run-{blocking}/{step}",
                step, save)
    finish()
""")


def _check(base, nproc, labels_equal=True):
  """What every test here asserts: each committed checkpoint under ``base``
  holds the data of one save; each save a process reported is committed
  with its data; every process raised for the same saves. Returns the
  outcomes, by label, of each process."""
  runs = []
  for i in range(nproc):
    with open(os.path.join(base, f"out-{i}.json")) as f:
      runs.append(json.load(f))
  for root, dirs, files in os.walk(base):
    if "jaxworks_manifest.json" in files:
      w = numpy_read(root)["w"]
      assert np.unique(w).size == 1, (root, np.unique(w))
  for i, run in enumerate(runs):
    for path, k in run["claims"]:
      assert os.path.isdir(path), (f"process {i} reported {path}", run)
      got = numpy_read(path)["w"]
      assert (got == k).all(), (path, k, np.unique(got))
  by_label = [{o[0]: o[1:] for o in run["outcomes"]} for run in runs]
  if labels_equal:
    for label, (kind, text, _) in by_label[0].items():
      kinds = [b[label][0] == "ok" for b in by_label]
      assert len(set(kinds)) == 1, (label, [b[label] for b in by_label])
  return by_label


def test_a_save_one_process_refused_before_it_began_mixes_nothing(tmp_path):
  """Process 1 refuses a tree key (a check before anything was written);
  the next saves of both processes each commit their own step only, and
  every process raised for the refused save."""
  base = str(tmp_path)
  run_n(REFUSED, base, 2, extra=("2",))
  by_label = _check(base, 2)
  assert by_label[1]["save-refused"][0] == "ValueError"
  assert by_label[0]["save-refused"][0] == "RuntimeError"
  assert "failed on process 1" in by_label[0]["save-refused"][1]
  assert by_label[0]["save-next"][0] == "ok"
  assert not os.path.exists(os.path.join(base, "a"))
  for blocking in (True, False):
    run = os.path.join(base, f"run-{blocking}")
    assert sorted(os.listdir(run)) == ["2", "3", "4", "5"], os.listdir(run)


# The steps of a collective save, in order (module, name): a failure is
# injected at each, on one process at a time. Steps a process does not take
# (process 0's alone) fail nothing there.
STEPS = textwrap.dedent("""
    STEPS = [(api, "positive"), (writer, "Leaves"),
             (pending, "raise_background_error"), (writer, "host_array"),
             (destination, "check_target"), (pending, "reserve"),
             (multiprocess, "plan_save"), (hostvalue, "start_copy"),
             (multiprocess._Board, "post"), (commit, "locked"),
             (commit, "clean"), (commit, "temp_name"),
             (multiprocess._Board, "wait"), (multiprocess, "agree"),
             (writer, "write_directory"), (hostvalue, "write_npy"),
             (commit, "fsync_dirs"), (hostvalue, "digest"),
             (multiprocess, "_check_agreement"), (multiprocess, "_final"),
             (commit, "publish"), (steps, "to_remove")]

    def inject(owner, name):
      # owner.name raises OSError once; returns the undo.
      real = owner.__dict__.get(name)
      if real is None:  # a step this version does not have
        return lambda: None
      fired = []
      def boom(*a, **k):
        if not fired:
          fired.append(1)
          raise OSError(5, f"boom-{name}")
        return real(*a, **k)
      setattr(owner, name, boom)
      return lambda: setattr(owner, name, real)
""")

PROPERTY_STEPS = textwrap.dedent("""
    victims = [int(v) for v in sys.argv[5].split(",")]
    k = 0
    # Retention runs (to_remove) but keeps every step: each is checked.
    mgr = bt.CheckpointManager(f"{base}/run", barrier_timeout_s=T)
    for victim in victims:
      for owner, name in STEPS:
        for kind in ("save", "step"):
          for failing in (True, False):  # a failure, then a save that works
            k += 1
            undo = (inject(owner, name) if failing and process_id == victim
                    else lambda: None)
            label = f"{kind}-{victim}-{name}-{failing}"
            try:
              if kind == "save":  # blocking, to a new path
                path = f"{base}/s{k}"
                attempt(label, path, k, lambda: bt.save(
                    path, tree(k), barrier_timeout_s=T))
              else:  # the manager, non-blocking
                path = f"{base}/run/{k}"
                def step():
                  mgr.save(k, tree(k), blocking=False)
                  mgr.wait_until_finished()
                attempt(label, path, k, step)
            finally:
              undo()
    finish()
""")


PROPERTY = SETUP + STEPS + PROPERTY_STEPS


def _property(tmp_path, nproc, victims, devices):
  base = str(tmp_path)
  run_n(
    PROPERTY, base, nproc, devices=devices, timeout=400,
    extra=(str(nproc), ",".join(map(str, victims))),
  )  # fmt: skip
  by_label = _check(base, nproc)
  # Each injected failure was met by every process (or by none, at a step
  # the victim does not take), fast; the save after it worked.
  failed = 0
  for label, outcome in by_label[0].items():
    kind, took = outcome[0], outcome[2]
    assert took < 10, (label, outcome)
    if label.endswith("-False"):
      assert kind == "ok", (label, [b[label] for b in by_label])
    elif kind != "ok":
      failed += 1
      victim = int(label.split("-")[1])
      assert by_label[victim][label][0] == "OSError", label
      assert "boom-" in by_label[victim][label][1], label
  return failed


def test_a_failure_at_every_step_of_the_protocol_on_one_process(tmp_path):
  """Two processes; each step of a collective save fails on process 0, then
  on process 1 (a blocking save, and a manager's non-blocking step), and a
  save follows each failure: see _check."""
  failed = _property(tmp_path, 2, (0, 1), devices=2)
  assert failed >= 30, failed


FORTRAN = SETUP + textwrap.dedent("""
    # A leaf in Fortran order, equal on every process (process 0 writes it
    # in Fortran order, the others check its values).
    f = np.asfortranarray(np.arange(12.0, dtype=np.float32).reshape(3, 4))
    mgr = bt.CheckpointManager(f"{base}/run", barrier_timeout_s=T)
    for k, blocking in ((1, True), (2, False)):
      path = f"{base}/f{k}"
      def save():
        h = bt.save(path, {**tree(k), "f": f}, blocking=blocking,
                    barrier_timeout_s=T)
        if h is not None:
          h.wait()
        mgr.save(k, {**tree(k), "f": f}, blocking=blocking)
        mgr.wait_until_finished()
      attempt(f"fortran-{k}", path, k, save)
      out = bt.restore(path, {"w": jax.ShapeDtypeStruct((4 * jax.device_count(), 4),
                                                        np.float32, sharding=rows),
                              "n": np.zeros(3, np.int32), "f": f})
      assert np.array_equal(np.asarray(out["f"]), f)
    # Different values in Fortran order are still refused.
    g = f + process_id
    attempt("fortran-differ", f"{base}/g", 3,
            lambda: bt.save(f"{base}/g", {**tree(3), "f": g}, barrier_timeout_s=T))
    finish()
""")


def test_a_fortran_ordered_leaf_equal_on_every_process_is_saved(tmp_path):
  base = str(tmp_path)
  run_n(FORTRAN, base, 2, devices=2, extra=("2",))
  by_label = _check(base, 2)
  assert by_label[0]["fortran-1"][0] == "ok", by_label[0]
  assert by_label[0]["fortran-2"][0] == "ok", by_label[0]
  assert by_label[0]["fortran-differ"][0] == "ValueError", by_label[0]
  text = by_label[0]["fortran-differ"][1]
  assert "differs between process 0 and process 1" in text, text
  want = np.arange(12.0, dtype=np.float32).reshape(3, 4)
  for path in ("f1", "f2", "run/1", "run/2"):
    got = numpy_read(os.path.join(base, path))["f"]
    assert np.array_equal(got, want), path


DEAD = SETUP + textwrap.dedent("""
    # Process 2 dies (SIGKILL) while it writes its shards.
    import signal
    bt.save(f"{base}/first", tree(1), barrier_timeout_s=T)
    if process_id == 2:
      hostvalue.write_npy = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    if process_id == 0:  # process 1 waits for the outcome, and gives up, first
      real = hostvalue.write_npy
      def slow(*a):
        time.sleep(1.0)
        return real(*a)
      hostvalue.write_npy = slow
    attempt("dead", f"{base}/second", 2,
            lambda: bt.save(f"{base}/second", tree(2), barrier_timeout_s=3))
    with open(f"{base}/out-{process_id}.json", "w") as f:
      json.dump({"claims": claims, "outcomes": outcomes}, f)
    print("WORKER-OK", process_id, flush=True)
    # Process 0 runs the store: it leaves once process 1 is done with it.
    while process_id == 0 and not os.path.exists(f"{base}/out-1.json"):
      time.sleep(0.05)
    os._exit(0)  # jax.distributed's shutdown would wait for process 2
""")


def test_a_process_that_died_is_named_by_the_others(tmp_path):
  """Three processes; process 2 is killed while writing: processes 0 and 1
  raise TimeoutError naming process 2 (not each other), and nothing is
  committed."""
  base = str(tmp_path)
  with open(os.path.join(base, "out-2.json"), "w") as f:
    json.dump({"claims": [], "outcomes": [["dead", "killed", "", 0]]}, f)
  run_n(DEAD, base, 3, devices=2, extra=("3",), dead=(2,))
  by_label = _check(base, 3, labels_equal=False)
  for p in (0, 1):
    kind, text, _ = by_label[p]["dead"]
    assert kind == "TimeoutError", (p, kind, text)
    assert "for process 2 to finish writing" in text, (p, text)
  assert sorted(n for n in os.listdir(base) if not n.startswith("out-")) == [
    "first"
  ]


def test_a_failure_at_every_step_with_four_processes(tmp_path):
  """As above with four processes (two devices each), the failures on each
  of them in turn."""
  failed = _property(tmp_path, 4, (0, 1, 2, 3), devices=2)
  assert failed >= 60, failed
