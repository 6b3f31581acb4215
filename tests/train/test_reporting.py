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


def test_the_metrics_file_is_json_lines_flushed_as_it_goes_and_appended_by_a_resume(tmp_path):
    """--metrics-out: each record is on disk once written (a process killed with SIGKILL, never closing the file,
    leaves them); a resumed run appends; the reader takes each step's newest record and leaves out a line cut short."""
    import json
    import subprocess
    import sys

    from megakit.train.observe.metrics import read_metrics

    path = tmp_path / "m.jsonl"
    killed = (
        "import os, signal, sys\nfrom megakit.train.observe.reporting import MetricsFile\n"
        "f = MetricsFile(sys.argv[1])\nf.write('run', {'start_step': 0})\n"
        "for step in range(3):\n    f.write('step', {'step': step, 'loss': 10.0 - step})\n"
        "f.write('eval', {'step': 2, 'loss': 7.5})\nf.write('event', {'step': 1, 'kind': 'skipped'})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", killed, str(path)]).returncode == -9
    lines = path.read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["run", "step", "step", "step", "eval", "event"]
    from megakit.train.observe.reporting import MetricsFile

    resumed = MetricsFile(str(path))  # the resume from step 1 appends
    resumed.write("run", {"start_step": 1})
    resumed.write("step", {"step": 1, "loss": 1.0})
    resumed.write("memory", {"rows": [{"rank": 0}]})
    resumed.close()
    with open(path, "a") as f:
        f.write('{"type": "step", "step": 2, "lo')  # a write cut short by a kill
    got = read_metrics(path)
    assert [r["start_step"] for r in got["runs"]] == [0, 1]
    assert [(s["step"], s["loss"]) for s in got["steps"]] == [(0, 10.0), (1, 1.0), (2, 8.0)]
    assert got["eval"] == [{"step": 2, "loss": 7.5}] and got["events"] == [{"step": 1, "kind": "skipped"}]
    assert got["memory"] == [{"rank": 0}]
    again = MetricsFile(str(path))  # the next resume starts on a line of its own, after the one cut short
    again.write("run", {"start_step": 2})
    again.close()
    assert [r["start_step"] for r in read_metrics(path)["runs"]] == [0, 1, 2]
    with open(path, "a") as f:
        f.write("3\n[1, 2]\n")  # JSON, but not a record of ours (an older --metrics-out at the same path)
    assert read_metrics(path)["steps"] == got["steps"]


def test_the_start_up_line_says_the_cp_mode():
    """ring, a2a (Ulysses: the all-to-all over all of CP) or hybrid with its all-to-all degree; nothing without CP."""
    import dataclasses

    from megakit.core.layout import Layout
    from megakit.train.observe.reporting import layout_words

    def words(world, cp_a2a=1, **axes):
        return layout_words(dataclasses.replace(Layout.for_world(world, **axes), cp_a2a=cp_a2a), vpp=1)

    assert words(4, cp=2) == "TP 1 x PP 1 x CP 2 (ring) x DP 2"
    assert words(4, cp=2, cp_a2a=2) == "TP 1 x PP 1 x CP 2 (a2a) x DP 2"
    assert words(8, cp=8, cp_a2a=4) == "TP 1 x PP 1 x CP 8 (hybrid, all-to-all over 4) x DP 1"
    assert words(8, tp=2, pp=2) == "TP 2 x PP 2 x DP 2"
    assert words(4, tp=2, ep=2) == "TP 2 x PP 1 x DP 2 (experts: EP 2 x EDP 2)"
