"""Every public class of the five packages reports its public module: the
name a traceback, ``repr`` and a pickle show is the one users import
(``jaxworks.batched_transfer.SpecRankError``), never a private ``_src``
module, and an error pickled that way loads again."""

import importlib
import pickle

import pytest

PACKAGES = ["axis_names", "batched_transfer", "jit_cache", "pmap_chunked",
            "stages_aot"]  # fmt: skip


def public_classes():
  for package in PACKAGES:
    module = importlib.import_module(f"jaxworks.{package}")
    for name in module.__all__:
      value = getattr(module, name)
      if isinstance(value, type):
        yield package, name, value


CLASSES = list(public_classes())


def test_there_are_public_classes():
  assert len(CLASSES) >= 25  # names in __all__ (a few shared by packages)


@pytest.mark.parametrize(
  ("package", "name", "cls"), CLASSES, ids=[f"{p}.{n}" for p, n, _ in CLASSES]
)
def test_a_public_class_names_its_public_module(package, name, cls):
  owner = importlib.import_module(cls.__module__)
  assert cls.__module__.startswith("jaxworks.") and "._" not in cls.__module__
  assert getattr(owner, cls.__qualname__) is cls
  assert repr(cls) == f"<class '{cls.__module__}.{cls.__qualname__}'>"
  if issubclass(cls, Exception) and cls.__name__ != "AxisNameError":
    err = cls("a message")  # (AxisNameError takes keyword-only fields)
    assert type(pickle.loads(pickle.dumps(err))) is cls
    assert f"{cls.__module__}.{cls.__qualname__}: a message" in "".join(
      __import__("traceback").format_exception_only(err)
    )
