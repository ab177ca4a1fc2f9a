"""A consumer of one jaxworks package: it builds and runs against batched_transfer alone."""

import importlib.util
import unittest

import jax
import numpy as np


class ConsumerTest(unittest.TestCase):
  def test_uses_the_package_and_its_extension(self):
    from jaxworks import batched_transfer

    tree = {
      "w": np.arange(6.0, dtype=np.float32).reshape(2, 3),
      "b": np.ones(3, np.float32),
    }
    device = jax.devices()[3]
    placed = batched_transfer.device_put(tree, device)
    expected = jax.device_put(tree, device)
    for key in tree:
      self.assertEqual(placed[key].devices(), {device})
      np.testing.assert_array_equal(placed[key], expected[key])
    plan = batched_transfer.plan(tree, device)
    self.assertIn("group", str(plan).lower())

  def test_only_that_package_is_present(self):
    self.assertEqual(jax.device_count(), 8)
    for other in ["jit_cache", "stages_aot", "pmap_chunked", "axis_names"]:
      self.assertIsNone(importlib.util.find_spec(f"jaxworks.{other}"), other)


if __name__ == "__main__":
  unittest.main()
