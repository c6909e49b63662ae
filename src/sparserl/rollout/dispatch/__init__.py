"""Where rollouts run: the rows-in-flight scheduler, a step's shards, and the backends that sample them (in this
process, or on Ray workers). Importing this package registers every backend: a new one is a file here plus its
line below."""

from . import local, ray_workers  # noqa: F401 - each registers its backend
