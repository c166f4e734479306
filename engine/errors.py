"""The one error type users see: a single line that names the problem."""


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
