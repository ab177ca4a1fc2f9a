"""CheckpointManagerOptions: the manager's settings as one object, as
orbax's users write them; the same manager as the keywords give, and one
source per setting (options= with a keyword other than its default is
refused, naming it)."""

import dataclasses
import datetime
import inspect
import re

import numpy as np
import pytest

from jaxworks import batched_transfer as bt


def test_the_fields_are_the_keywords_with_their_defaults():
  keywords = {
    name: p.default
    for name, p in inspect.signature(bt.CheckpointManager).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name != "options"
  }
  fields = {
    f.name: f.default for f in dataclasses.fields(bt.CheckpointManagerOptions)
  }
  assert fields == keywords


def test_options_make_the_manager_the_keywords_make(tmp_path):
  settings = {
    "max_to_keep": 2,
    "keep_period": 4,
    "save_interval_steps": 3,
    "barrier_timeout_s": 12.0,
    "best_fn": lambda m: m["acc"],
    "best_mode": "min",
    "keep_checkpoints_without_metrics": False,
    "keep_time_interval": datetime.timedelta(hours=1),
    "save_on_steps": [5],
    "step_prefix": "ckpt",
    "step_format_fixed_length": 4,
    "item_names": ("state",),
  }
  by_options = bt.CheckpointManager(
    tmp_path / "a", options=bt.CheckpointManagerOptions(**settings)
  )
  by_keywords = bt.CheckpointManager(tmp_path / "b", **settings)
  for name in settings:
    assert getattr(by_options, name) == getattr(by_keywords, name), name
  for mgr in (by_options, by_keywords):
    for step in range(7):
      if mgr.should_save(step):
        mgr.save(step, items={"state": {"x": np.arange(3.0)}},
                 metrics={"acc": float(step)}, blocking=True)  # fmt: skip
  # Saved 0, 3 and 5; the two best (lowest) kept.
  assert by_options.all_steps() == by_keywords.all_steps() == [0, 3]
  names = [sorted(p.name for p in (tmp_path / d).glob("ckpt_*")) for d in "ab"]
  assert names[0] == names[1] == ["ckpt_0000", "ckpt_0003"]
  assert repr(by_options).replace("/a'", "/b'") == repr(by_keywords)


def test_options_and_keywords_together_are_refused(tmp_path):
  options = bt.CheckpointManagerOptions(max_to_keep=3)
  with pytest.raises(TypeError, match="max_to_keep, read_only passed both"):
    bt.CheckpointManager(
      tmp_path, options=options, max_to_keep=5, read_only=True
    )
  # A keyword left at its default is no second source.
  mgr = bt.CheckpointManager(tmp_path, options=options, max_to_keep=None)
  assert mgr.max_to_keep == 3
  with pytest.raises(TypeError, match="must be a jaxworks.batched_transfer"):
    bt.CheckpointManager(tmp_path, options={"max_to_keep": 3})


def test_options_are_checked_as_the_keywords(tmp_path):
  with pytest.raises(ValueError, match="max_to_keep must be a positive int"):
    bt.CheckpointManager(
      tmp_path, options=bt.CheckpointManagerOptions(max_to_keep=0)
    )


def test_the_class_reports_its_public_module():
  cls = bt.CheckpointManagerOptions
  assert cls.__module__ == "jaxworks.batched_transfer"
  assert "CheckpointManagerOptions" in bt.__all__


@pytest.mark.parametrize(
  "name, value, exc, fix",
  [
    ("best_mode", "lowest", ValueError, "best_mode='min'"),
    ("max_to_keep", 0, ValueError, "max_to_keep=5"),
    ("keep_period", -2, ValueError, "keep_period=1000"),
    ("save_interval_steps", None, ValueError, "save_interval_steps=100"),
    ("barrier_timeout_s", 0, ValueError, "barrier_timeout_s=300.0"),
    ("keep_time_interval", 60, TypeError, "datetime.timedelta(hours=1)"),
    ("step_prefix", "a/b", ValueError, "step_prefix='ckpt'"),
    ("step_format_fixed_length", 0, ValueError, "step_format_fixed_length="),
    ("best_fn", "loss", TypeError, "best_fn=lambda"),
    ("should_save_fn", 3, TypeError, "should_save_fn="),
    ("save_on_steps", 5, TypeError, "save_on_steps=[1000, 5000]"),
    ("compression", "lz4", ValueError, "'zstd'"),
  ],
)
@pytest.mark.parametrize(
  "via", ["CheckpointManager", "CheckpointManagerOptions"]
)
def test_a_bad_setting_is_named_as_the_user_passed_it(
  tmp_path, name, value, exc, fix, via
):
  if via == "CheckpointManager":
    call = lambda: bt.CheckpointManager(tmp_path, **{name: value})  # noqa: E731
  else:
    options = bt.CheckpointManagerOptions(**{name: value})
    call = lambda: bt.CheckpointManager(tmp_path, options=options)  # noqa: E731
  with pytest.raises(exc) as info:
    call()
  text = str(info.value)
  assert text.startswith("jaxworks.batched_transfer.CheckpointManager: ")
  assert f"{via}({name}={value!r})" in text, text
  assert fix in text, text
  assert not re.search(r"\bo\.[a-z]", text)  # no internal names
