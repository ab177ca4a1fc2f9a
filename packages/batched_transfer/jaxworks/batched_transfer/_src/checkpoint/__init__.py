"""Checkpoints: leaf keys, save (durable and atomic, blocking or not), the
step manager. The file format and restore are in ``checkpoint_files`` and
``checkpoint_restore`` beside this package."""

from .keys import leaf_keys as leaf_keys
from .keys import python_scalar_dtype as python_scalar_dtype
from .saver import save as save
