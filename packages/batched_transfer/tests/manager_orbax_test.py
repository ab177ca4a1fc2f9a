"""CheckpointManager against orbax-checkpoint's: the same options and the
same steps and metrics give the same steps kept, best step and step names;
and the README's "Coming from orbax" table names calls that exist on both
sides with the parameters it lists."""

import dataclasses
import datetime
import inspect
import os
import re

import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm
import pytest

from jaxworks import batched_transfer as bt

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def tree(step):
  return {"w": np.full((2,), step, np.float32)}


def run_orbax(directory, steps, metrics, **options):
  mgr = ocp.CheckpointManager(
    directory, options=ocp.CheckpointManagerOptions(**options)
  )
  saved = []
  for entry in steps:
    step, force = entry if isinstance(entry, tuple) else (entry, False)
    m = metrics(step) if metrics else None
    args = ocp.args.StandardSave(tree(step))
    if mgr.save(step, args=args, metrics=m, force=force):
      saved.append(step)
  mgr.wait_until_finished()
  # orbax lists the steps in save order within a session (ascending after
  # a restart); ours are always ascending.
  out = saved, sorted(mgr.all_steps()), mgr.best_step()
  mgr.close()
  return out, sorted(os.listdir(directory))


def run_ours(directory, steps, metrics, **options):
  mgr = bt.CheckpointManager(directory, **options)
  saved = []
  for entry in steps:
    step, force = entry if isinstance(entry, tuple) else (entry, False)
    m = metrics(step) if metrics else None
    if mgr.save(step, tree(step), metrics=m, force=force):
      saved.append(step)
    mgr.wait_until_finished()  # orbax deletes when the next save starts
  out = saved, mgr.all_steps(), mgr.best_step()
  mgr.close()
  return out, sorted(os.listdir(directory))


def acc(step):
  return {"acc": float((step * 7) % 5), "loss": 1.0 / (1 + step)}


CASES = {
  "latest": (range(1, 9), None, dict(max_to_keep=3)),
  "interval_and_period": (
    range(0, 20),
    None,
    dict(max_to_keep=2, save_interval_steps=3, keep_period=4),
  ),
  "save_on_steps": (
    range(1, 14),
    None,
    dict(save_interval_steps=5, save_on_steps=[2, 7, 11]),
  ),
  "should_save_fn": (
    range(1, 14),
    None,
    dict(should_save_fn=lambda s, last: last is None or s - last >= 3),
  ),
  "best_max": (
    range(1, 11),
    acc,
    dict(max_to_keep=2, best_fn=lambda m: m["acc"], best_mode="max"),
  ),
  "best_min": (
    range(1, 11),
    acc,
    dict(max_to_keep=3, best_fn=lambda m: m["loss"], best_mode="min"),
  ),
  "best_and_period": (
    range(1, 11),
    acc,
    dict(max_to_keep=1, best_fn=lambda m: m["acc"], keep_period=4),
  ),
  "best_some_without_metrics": (
    range(1, 11),
    lambda s: acc(s) if s % 3 else None,
    dict(max_to_keep=2, best_fn=lambda m: m["acc"]),
  ),
  "best_drop_without_metrics": (
    range(1, 11),
    lambda s: acc(s) if s % 3 else None,
    dict(
      max_to_keep=2,
      best_fn=lambda m: m["acc"],
      keep_checkpoints_without_metrics=False,
    ),
  ),
  "no_best_fn": (range(1, 6), acc, dict(max_to_keep=2)),
  "names": (
    [5, 50, 500],
    None,
    dict(max_to_keep=2, step_prefix="ckpt", step_format_fixed_length=6),
  ),
  "names_prefix_only": ([3, 30], None, dict(step_prefix="run")),
  # save(step, force=True) of a step older than the newest: retention keeps
  # the last saved, as orbax (its newest is the last saved, not the highest).
  "force_older": ([10, (5, True)], None, dict(max_to_keep=1)),
  "force_older_unforced": ([10, 5, 7], None, dict(max_to_keep=1)),
  "force_older_then_newer": (
    [1, 10, (5, True), 11, 12, (3, True)],
    None,
    dict(max_to_keep=2),
  ),
  "force_older_and_period": (
    [10, (5, True), (3, True), 20],
    None,
    dict(max_to_keep=2, keep_period=5),
  ),
  "force_older_best": (
    [1, 2, 3, 4, (3, True), 6, (1, True), 8],
    acc,
    dict(max_to_keep=2, best_fn=lambda m: m["acc"]),
  ),
  "force_older_best_ties": (
    [5, 10, (0, True), 15, (20, True)],
    lambda s: {"acc": 1.0},
    dict(max_to_keep=2, best_fn=lambda m: m["acc"]),
  ),
}


@pytest.mark.filterwarnings("ignore:.*without metrics")
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_steps_best_step_and_names_as_orbax(tmp_path, case):
  steps, metrics, options = CASES[case]
  theirs, their_names = run_orbax(tmp_path / "orbax", steps, metrics, **options)
  ours, our_names = run_ours(tmp_path / "ours", steps, metrics, **options)
  assert ours == theirs
  their_names = [n for n in their_names if not n.startswith("_")]
  assert our_names == their_names  # orbax adds a metadata directory


def _scenario(rng):
  """Random steps (some forced, older than the newest), options and
  metrics; every step saved at most once (orbax refuses a step twice)."""
  steps, used = [], set()
  for _ in range(int(rng.integers(3, 9))):
    step = int(rng.integers(0, 30))
    if step in used:
      continue
    used.add(step)
    steps.append((step, True) if rng.random() < 0.4 else step)
  options = {"max_to_keep": int(rng.integers(1, 4))}
  if rng.random() < 0.3:
    options["keep_period"] = int(rng.integers(2, 6))
  metrics = None
  if rng.random() < 0.5:
    scores = {s: float(rng.integers(0, 4)) for s in range(30)}  # ties too
    no_metrics = rng.random() < 0.3

    def metrics(s, scores=scores, no_metrics=no_metrics):
      return None if no_metrics and s % 3 == 0 else {"acc": scores[s]}

    options["best_fn"] = lambda m: m["acc"]
    options["best_mode"] = str(rng.choice(["max", "min"]))
    options["keep_checkpoints_without_metrics"] = bool(rng.random() < 0.5)
  return steps, metrics, options


@pytest.mark.filterwarnings("ignore:.*without metrics")
def test_retention_fuzzed_against_orbax(tmp_path):
  """Seeded random scenarios (steps forced out of order among them): the
  same steps saved and kept as orbax, the same best (or latest) step."""
  rng = np.random.default_rng(0)
  for n in range(85):
    steps, metrics, options = _scenario(rng)
    theirs, _ = run_orbax(tmp_path / f"o{n}", steps, metrics, **options)
    ours, _ = run_ours(tmp_path / f"j{n}", steps, metrics, **options)
    assert ours == theirs, (n, steps, options)


def test_keep_time_interval_as_orbax_every_n_seconds(tmp_path):
  interval = datetime.timedelta(seconds=25, milliseconds=900)  # 25 s, as orbax
  t0 = 1_700_000_000
  offsets = [0, 9, 20, 25, 26, 40, 52, 60, 77, 78, 100]
  mgr = bt.CheckpointManager(tmp_path, keep_time_interval=interval)
  for step, dt in enumerate(offsets):
    mgr.save(step, tree(step), blocking=True)
    os.utime(tmp_path / str(step), (t0 + dt, t0 + dt))
  infos = [  # orbax's PolicyCheckpointInfo protocol
    _Info(s, datetime.datetime.fromtimestamp(t0 + dt), None)
    for s, dt in enumerate(offsets)
  ]
  policy = ocm.EveryNSeconds(interval_secs=int(interval.total_seconds()))
  theirs = policy.should_preserve(infos, context=ocm.PreservationContext())
  mgr.max_to_keep = 1  # retention over the same steps and times
  removed = mgr._to_remove(mgr.all_steps())
  kept = [s for s in mgr.all_steps() if s not in removed]
  # orbax's LatestN(1) keeps the newest as well.
  expected = sorted(
    {s for s, keep in zip(range(len(offsets)), theirs) if keep}
    | {len(offsets) - 1}
  )
  assert kept == expected
  assert kept != list(range(len(offsets)))


@dataclasses.dataclass
class _Info:
  step: int
  time: datetime.datetime
  metrics: dict | None


def test_read_only_as_orbax(tmp_path):
  bt.CheckpointManager(tmp_path).save(1, tree(1), blocking=True)
  theirs = ocp.CheckpointManager(
    tmp_path / "o", options=ocp.CheckpointManagerOptions(read_only=True)
  )
  assert not theirs.should_save(2)
  ours = bt.CheckpointManager(tmp_path, read_only=True)
  assert not ours.should_save(2)
  with pytest.warns(UserWarning):
    assert ours.save(2, tree(2)) is False
  assert ours.all_steps() == [1]


# The README table: | orbax call | jaxworks call | note |.


def _table():
  with open(README) as f:
    text = f.read()
  start = text.index("### Coming from orbax")
  end = text.find("\n#", start + 1)
  rows = []
  for line in text[start:end].splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 3 or not line.startswith("|"):
      continue
    if cells[0].startswith("---") or cells[0] == "orbax call":
      continue
    rows.append(cells)
  return rows


def _calls(cell):
  """[(dotted name, [parameter names])] of each backticked call in a cell."""
  out = []
  for code in re.findall(r"`([^`]+)`", cell):
    code = code.replace("().", ".")  # ocp.StandardCheckpointer().save(...)
    m = re.match(r"^([A-Za-z_][\w.]*)(\(.*\))?$", code.strip())
    if m is None:
      continue
    name, args = m.group(1), m.group(2)
    params = []
    if args:
      depth, part, parts = 0, "", []
      for c in args[1:-1]:
        if c in "([{":
          depth += 1
        elif c in ")]}":
          depth -= 1
        if c == "," and depth == 0:
          parts.append(part)
          part = ""
        else:
          part += c
      parts.append(part)
      for p in parts:
        p = p.strip()
        k = re.match(r"^\*{0,2}([A-Za-z_]\w*)\s*(=|$)", p)
        if k and p not in ("...",):
          params.append(k.group(1))
    out.append((name, params))
  return out


def _ours(name):
  head, _, rest = name.partition(".")
  obj = {"bt": bt, "mgr": bt.CheckpointManager}[head]
  for part in rest.split("."):
    obj = getattr(obj, part)
  return obj


def _signature(obj):
  return inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)


def test_readme_table_covers_the_calls():
  rows = _table()
  orbax = " ".join(r[0] for r in rows)
  for call in (
    "CheckpointManagerOptions",
    "save",
    "restore",
    "all_steps",
    "latest_step",
    "best_step",
    "should_save",
    "delete",
    "wait_until_finished",
    "is_saving_in_progress",
    "check_for_errors",
    "reload",
    "metadata",
    "item_metadata",
    "close",
    "StandardCheckpointer",
    "Composite",
    "JsonSave",
    "partial_restore",
  ):
    assert call in orbax, call


@pytest.mark.parametrize("row", range(len(_table())))
def test_readme_table_row_names_real_calls(row):
  theirs, ours, _ = _table()[row]
  calls = _calls(ours)
  assert calls, ours
  for name, params in calls:
    obj = _ours(name)
    if callable(obj) and params:
      have = _signature(obj).parameters
      for p in params:
        assert p in have, (name, p, list(have))
  for name, params in _calls(theirs):
    head, _, rest = name.partition(".")
    if head == "mgr":
      obj = ocp.CheckpointManager
    elif head == "ocp":
      obj = ocp
    else:
      continue
    for part in rest.split("."):
      assert hasattr(obj, part), (name, part)
      obj = getattr(obj, part)
    if name.endswith("CheckpointManagerOptions"):
      fields = {f.name for f in dataclasses.fields(obj)}
      assert set(params) <= fields, set(params) - fields
    elif callable(obj) and head == "mgr" and params:
      have = inspect.signature(obj).parameters
      for p in params:
        assert p in have, (name, p, list(have))


def test_table_parser_reads_parameters():
  assert _calls(
    "`mgr.save(step, items={'a': t}, metrics=m)` and `bt.save`"
  ) == [
    ("mgr.save", ["step", "items", "metrics"]),
    ("bt.save", []),
  ]
  assert _calls("`ocp.StandardCheckpointer().save(path, tree)`") == [
    ("ocp.StandardCheckpointer.save", ["path", "tree"])
  ]
  with pytest.raises(AttributeError):
    _ours("mgr.no_such_call")
