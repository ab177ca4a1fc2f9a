"""tools/py/lru.py, the bounded LRU every jaxworks cache uses, against a
reference model on random operation sequences."""

import random
import weakref

import lru
import pytest


def test_matches_a_list_model_on_random_operations():
  rng = random.Random(0)
  for trial in range(200):
    maxsize = rng.choice([None, 0, 1, 2, 5])
    cache = lru.LRU(maxsize)
    model: list[tuple[int, int]] = []  # oldest first
    for _ in range(60):
      op, key, value = rng.choice("gppxr"), rng.randrange(8), rng.random()
      index = next((i for i, (k, _) in enumerate(model) if k == key), None)
      if op == "g":
        want = None if index is None else model[index][1]
        if index is not None:
          model.append(model.pop(index))
        assert cache.get(key) == want
      elif op == "p":
        if index is not None:
          model.pop(index)
        model.append((key, value))
        evicted = []
        while maxsize is not None and len(model) > maxsize:
          evicted.append(model.pop(0))
        assert cache.put(key, value) == evicted
      elif op == "x":
        want = None if index is None else model.pop(index)[1]
        assert cache.pop(key) == want
      else:
        maxsize = rng.choice([None, 0, 1, 3])
        evicted = []
        while maxsize is not None and len(model) > maxsize:
          evicted.append(model.pop(0))
        assert cache.resize(maxsize) == evicted
      assert cache.items() == model, trial
      assert len(cache) == len(model)
      assert list(cache) == [k for k, _ in model]


def test_peek_and_membership_keep_the_order():
  cache = lru.LRU(2)
  cache.put("a", 1)
  cache.put("b", 2)
  assert cache.peek("a") == 1 and "a" in cache
  assert cache.put("c", 3) == [("a", 1)]
  assert cache.clear() == [("b", 2), ("c", 3)] and len(cache) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_bounds_are_refused(bad):
  with pytest.raises(ValueError, match="maxsize must be a non-negative int"):
    lru.LRU(bad)
  cache = lru.LRU(1)
  cache.put("a", 1)
  with pytest.raises(ValueError, match=repr(bad)):
    cache.resize(bad)
  assert cache.items() == [("a", 1)] and cache.maxsize == 1


def test_refresh_and_peek_keep_the_stored_key():
  class Obj:
    pass

  obj, gone = Obj(), []
  stored = weakref.ref(obj, gone.append)
  cache = lru.LRU(2)
  cache.put(stored, "v")
  cache.put("b", 2)
  cache.refresh(weakref.ref(obj))
  with pytest.raises(KeyError):
    cache.refresh("missing")
  assert list(cache) == ["b", stored] and list(cache)[1] is stored
  assert cache.peek("b") == 2 and list(cache) == ["b", stored]
  assert cache.peek("missing") is None and cache.peek("missing", 0) == 0
  assert cache.get(weakref.ref(obj)) == "v" and list(cache)[1] is stored
  assert cache.put(weakref.ref(obj), "w") == [] and list(cache)[1] is stored
  assert cache.popitem() == ("b", 2) and len(cache) == 1
  cache.clear()
  with pytest.raises(KeyError):
    cache.popitem()
  cache.put("c", 3)  # peek and refresh stay bound to the emptied mapping
  cache.refresh("c")
  assert cache.peek("c") == 3
