"""Checkpoints, laid out by layer (a module imports only those below it):
the on-disk format (format, keys, checksum); the fd-safe reader (reader);
writing (hostvalue, commit, pending, writer) and restoring (target,
progress, prefetch, restore_files, restore_shards); the multi-process save
(multiprocess); the front door, ``save``, ``restore`` and ``metadata``
(api); the step manager (steps, manager)."""
