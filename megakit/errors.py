"""One exception for every mistake a user can make: the CLI turns it into one line and exit status 2."""


class UsageError(ValueError):
    """Bad input from the user (a flag, a config file, a layout that does not divide).

    The message is one sentence naming the problem and the fix; the CLI prints it
    as ``megakit: error: <message>`` and exits with status 2, without a traceback.
    """
