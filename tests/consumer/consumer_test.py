"""A consumer of one jaxworks package: it builds and runs against that package alone."""

import importlib.util
import unittest

import jax


class ConsumerTest(unittest.TestCase):
    def test_uses_the_package(self):
        from jaxworks import zz_scratch
        self.assertEqual(zz_scratch.add(2, 3), 5)
        self.assertEqual(jax.device_count(), 8)

    def test_only_that_package_is_present(self):
        for other in ["jit_cache", "stages_aot", "pmap_chunked", "axis_names"]:
            self.assertIsNone(importlib.util.find_spec(f"jaxworks.{other}"), other)


if __name__ == "__main__":
    unittest.main()
