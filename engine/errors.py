"""The one error type users see: a single line that names the problem; and the argument parser that reports usage
errors the same way."""

import argparse
import sys


class EngineError(ValueError):
    """Bad input: a missing path, an unsupported checkpoint, a draft that does not fit, an invalid argument."""


class WeightsTooLarge(EngineError):
    """A model's or draft's weights exceed the free memory of the device they are loaded on."""


def env_switch(name: str) -> bool | None:
    """kernels.env_switch (an A/B switch of the environment: 1, 0, or unset/auto -> None), with a bad value as an
    EngineError."""
    from kernels import env_switch as read

    try:
        return read(name)
    except ValueError as e:
        raise EngineError(str(e)) from None


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line and exit code 2 (subcommands inherit it): the engine's CLI
    and the perf tools."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)
