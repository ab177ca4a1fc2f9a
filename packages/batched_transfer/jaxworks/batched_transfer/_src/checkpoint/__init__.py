"""Checkpoints: the format (files), leaf keys, save (durable and atomic,
blocking or not), restore, the step manager (manager) and the multi-process
commit (sharded), beside the transfer path they use."""

from .keys import leaf_keys as leaf_keys
from .keys import python_scalar_dtype as python_scalar_dtype
from .saver import save as save
