"""The `kestrel serve` command line of one data-parallel replica: the parent's options, its own port."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from kestrel.config import EngineConfig, cli_flag


def config_flags(config: EngineConfig) -> list[str]:
    """The flags that give `config` back through `kestrel serve`'s parser: every option whose value is not
    its default (a true bool as its bare flag)."""
    flags: list[str] = []
    for name, (section, field) in EngineConfig.options().items():
        value = getattr(getattr(config, section) if section else config, name)
        if value == field.default:
            continue
        if value is True:
            flags.append(cli_flag(name))
        elif isinstance(value, (list, tuple)):  # a flag of several values (--lora-paths A=P B=Q)
            flags += [cli_flag(name), *map(str, value)]
        else:
            flags += [cli_flag(name), str(value)]
    return flags


def replica_command(config: EngineConfig, served_model_names: Sequence[str], port: int) -> list[str]:
    """`python -m kestrel.cli serve` with the options of `config` (unresolved: as the user gave them), one
    replica (--dp-size 1), listening on `port`."""
    replica = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, dp_size=1),
                                  server=dataclasses.replace(config.server, port=port))
    command = [sys.executable, "-m", "kestrel.cli", "serve", *config_flags(replica)]
    if served_model_names:
        command += ["--served-model-name", *served_model_names]
    return command
