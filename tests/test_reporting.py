"""The progress bar is drawn only on a terminal: in a log file its carriage returns would run into the step lines."""

import io

from megakit.train.reporting import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_on_a_pipe_or_file_and_a_bar_on_a_terminal():
    assert progress_bar(10, 0, io.StringIO()) is None  # a pipe or a file: not a terminal
    terminal = _Terminal()
    bar = progress_bar(10, 2, terminal)
    assert bar is not None
    bar.update(1)
    bar.close()
    assert "\r" in terminal.getvalue() and "3/10" in terminal.getvalue()
