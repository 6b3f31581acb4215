"""The progress bar is drawn only on a terminal: in a log file its carriage returns would run into the step lines."""

import io

from megakit.train.observe.reporting import progress_bar


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


def test_a_long_step_prints_a_heartbeat_line_and_a_step_that_ends_resets_it():
    """The real thread against a clock the test moves: a line once per period of silence, none after a step ends,
    and the thread ends with ``stop`` or when its Heartbeat is dropped (a run that raised)."""
    import gc
    import threading
    import time

    from megakit.train.observe.reporting import Heartbeat

    now, said = [100.0], []
    beat = Heartbeat(0.2, step=5, say=said.append, clock=lambda: now[0])  # checks every 0.05 s of real time

    def settle():  # two of the thread's checks
        time.sleep(0.15)

    settle()
    assert said == []  # not yet a period of silence
    now[0] = 100.3
    settle()
    assert said == ["megakit: step 5 running for 0 s"], said  # one line per period, not one per check
    now[0] = 100.6
    settle()
    assert said[1:] == ["megakit: step 5 running for 1 s"], said
    beat.beat(6)  # step 5 ended: the next line waits a full period again
    now[0] = 100.7
    settle()
    assert len(said) == 2
    beat.stop()
    threads = lambda: [t for t in threading.enumerate() if t.name == "megakit-heartbeat"]  # noqa: E731
    time.sleep(0.1)
    assert not threads()
    Heartbeat(0.2, step=0, say=said.append, clock=lambda: now[0])  # dropped at once, never stopped
    gc.collect()
    time.sleep(0.15)
    assert not threads()
