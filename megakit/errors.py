"""One exception for every mistake a user can make: the CLI turns it into one line and exit status 2."""


class UsageError(ValueError):
    """Bad input from the user (a flag, a config file, a layout that does not divide).

    The message is one sentence naming the problem and the fix; the CLI prints it
    as ``megakit: error: <message>`` and exits with status 2, without a traceback.
    """


def finite_float(text: str) -> float:
    """argparse ``type=`` for a float flag: NaN and inf parse as floats but would train or plan nothing sensible."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number; give a finite value")
    return value
