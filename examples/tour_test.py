"""The tour (//examples:tour) runs to the end, prints every section and fails loudly on a wrong result."""

import importlib.util
import pathlib

import pytest

TOUR = pathlib.Path(__file__).with_name("tour.py")


@pytest.fixture(scope="module")
def tour():
  spec = importlib.util.spec_from_file_location("jaxworks_tour", TOUR)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_tour_prints_every_section_and_exits_0(tour, capsys):
  rc = tour.main([])
  out, err = capsys.readouterr()
  assert rc == 0, f"tour exited {rc}\n{out}\n{err}"
  for title in tour.SECTIONS:
    assert f"== {title} " in out, (
      f"section header {title!r} missing from the output"
    )
  headers = [line for line in out.splitlines() if line.startswith("== ")]
  assert len(headers) == len(tour.SECTIONS) == 8
  # The adoption section ran stock-JAX code with the three names swapped.
  assert "ok: the unchanged user code gives stock JAX's results" in out
  assert "ok: after the block stock JAX's names are back" in out
  assert "CHECK FAILED" not in out + err
  assert "All checks passed" in out
  # Each package's row of the side-by-side table.
  for package in (
    "axis_names",
    "batched_transfer",
    "jit_cache",
    "stages_aot",
    "pmap_chunked",
  ):
    assert f"   | {package} | " in out


def test_a_wrong_result_fails_the_tour(tour, capsys, monkeypatch):
  original = tour.stock_train_step
  # The stock reference trains with twice the learning rate: the comparison of section 3 must fail.
  monkeypatch.setattr(
    tour,
    "stock_train_step",
    lambda layer=None, lr=tour.LR: original(layer, lr * 2),
  )
  rc = tour.main([])
  out, err = capsys.readouterr()
  assert rc == 1
  assert (
    f"CHECK FAILED in section '{tour.SECTIONS[3]}': losses and parameters equal stock jax.pmap's"
    in err
  )
  assert f"== {tour.SECTIONS[4]} " not in out  # it stops at the failed section
