"""The `sparserl` subcommands, one file each, registered with `@command` where they are defined. Importing this
package registers every command, in the order of `sparserl --help`: a new one is a file here plus its line below."""

from . import warmup, sft, train, eval, sweep, audit, calibrate, compare, model, presets  # noqa: F401, I001 - registration lines, in help order
from .base import COMMANDS, Command, command  # noqa: E402, F401 - the registry, complete once the imports above ran
