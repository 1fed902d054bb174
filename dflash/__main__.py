"""`python -m dflash ...` (and `torchrun ... -m dflash run CONFIG`): the `dflash` command."""

from dflash.cli import entry

entry()
