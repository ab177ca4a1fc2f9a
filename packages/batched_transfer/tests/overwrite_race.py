"""Restores racing a thread that keeps replacing the checkpoint they read."""

import threading


def restore_while_replacing(save_version, restore, version_of, attempts):
  """Runs ``save_version(v)`` for v = 2, 3, ... on a thread (a short pause
  after each, so restores find a checkpoint at the path) while this thread
  restores with ``restore()``.

  Restores go on until ``attempts`` of them found a checkpoint (a save may be
  between removing the old one and putting the new one in:
  ``FileNotFoundError``), 20 of them succeeded, and the saver replaced the
  checkpoint more than 10 times (durable saves fsync: they are slower).

  Returns:
    (versions read, as ``version_of`` of each result: None for a mix;
    the ``ValueError``s raised; the versions saved).
  """
  stop = threading.Event()
  saved = [1]
  failures = []

  def saver():
    try:
      while not stop.is_set():
        v = saved[-1] + 1
        save_version(v)
        saved.append(v)
        stop.wait(0.005)
    except BaseException as err:  # reported below, on the test's thread
      failures.append(err)

  thread = threading.Thread(target=saver)
  thread.start()
  results, errors, missing = [], [], 0
  try:
    while (
      len(results) + len(errors) < attempts
      or len(results) < 20
      or len(saved) <= 10
    ) and len(results) + len(errors) + missing < 100_000:
      try:
        out = restore()
      except FileNotFoundError:
        missing += 1
      except ValueError as err:
        errors.append(err)
      else:
        results.append(version_of(out))
  finally:
    stop.set()
    thread.join()
  assert failures == []
  assert len(saved) > 10  # the checkpoint did change while restores ran
  return results, errors, saved
