"""Where a run's numbers go: rank 0's progress bar and log lines, TensorBoard, the metrics file, profiler traces.

Only rank 0 prints and writes (every rank computes the same per-step metrics);
each rank writes its own profiler trace, because ranks of different pipeline stages
do different work. Traces are written to a temporary name and renamed. The metrics file
(``--metrics-out``) is JSON Lines, one record per line appended and flushed as it happens
(``MetricsFile``), so a run that is killed, preempted or crashes keeps every step it logged and
nothing waits in memory for the end; ``megakit.train.observe.metrics.read_metrics`` reads it. The bar is drawn
only on a terminal: in a log file (a cluster job's stderr) its carriage returns would run
into the step lines, so there the log is one line per step or event, and grep-able, plus a
heartbeat line every ``--log-heartbeat`` seconds while a step (or a save, an evaluation) runs longer,
so a slow step is told apart from a stuck job in the log.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from megakit.errors import UsageError
from megakit.nn.attention.kernels import attention_kernels_in
from megakit.train.observe.metrics import StepMetrics


def start_profiler(directory: str | None, *, steps: int, rank: int):
    """A started torch profiler whose trace (steps 2-3, or what a short run has) lands in DIR/trace_rank{rank}.json;
    call ``.step()`` after every step and ``.stop()`` at the end. None without a directory."""
    if not directory:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def save(prof) -> None:
        prof.attention_kernels = attention_kernels_in(e.key for e in prof.key_averages())  # which SDPA kernel ran
        tmp = out / f".trace_rank{rank}.json.tmp"
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, out / f"trace_rank{rank}.json")

    wait = 1 if steps >= 4 else 0  # skip the first step (lazy initialisation) when there are enough
    warmup = 1 if steps >= 3 else 0
    prof = profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=min(2, steps - wait - warmup), repeat=1),
        on_trace_ready=save,
        record_shapes=False,
    )
    prof.start()
    return prof


def progress_bar(total: int, initial: int, stream=None):
    """A tqdm bar on ``stream`` (stderr) when it is a terminal; None otherwise (a file or a pipe)."""
    stream = sys.stderr if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=stream)


class Heartbeat:
    """A daemon thread that prints ``megakit: step N running for S s`` every ``every_s`` seconds while no step
    ends. ``beat(step)`` after each step; ``stop()`` at the end. The thread holds only a weak reference, so a
    run that ended by an exception (no ``stop``) does not leave it printing into the next one."""

    def __init__(self, every_s: float, *, step: int, say=None, clock=time.monotonic) -> None:
        self.every_s, self.step, self.clock = every_s, step, clock
        self.say = say or (lambda text: print(text, flush=True))
        self.since = self.last = clock()
        self._stop = threading.Event()
        threading.Thread(
            target=Heartbeat._run,
            args=(weakref.ref(self), self._stop, every_s / 4),
            daemon=True,
            name="megakit-heartbeat",
        ).start()

    def beat(self, step: int) -> None:
        """A step started: reset the heartbeat's clock."""
        self.step, self.since = step, self.clock()
        self.last = self.since

    def stop(self) -> None:
        """Stop the heartbeat thread."""
        self._stop.set()

    def check(self) -> None:
        """Say how long the current step has run, once per interval."""
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            self.say(f"megakit: step {self.step} running for {now - self.since:.0f} s")

    @staticmethod
    def _run(ref, stop: threading.Event, wait_s: float) -> None:
        while not stop.wait(wait_s):
            beat = ref()
            if beat is None:
                return
            beat.check()
            del beat


def cp_mode_words(layout) -> str:
    """How CP splits attention: ``ring``, ``a2a`` (Ulysses) or ``hybrid, all-to-all over N`` (``Layout.cp_a2a``)."""
    if layout.cp_a2a == layout.cp:
        return "a2a"
    return f"hybrid, all-to-all over {layout.cp_a2a}" if layout.cp_a2a > 1 else "ring"


def layout_words(layout, *, vpp: int = 1) -> str:
    """The start-up line's layout: ``TP 2 x PP 2 (x 2 chunks) x CP 2 (a2a) x DP 1 (experts: EP 2 x EDP 2)``."""
    chunks = f" (x {vpp} chunks)" if vpp > 1 else ""
    cp = f"x CP {layout.cp} ({cp_mode_words(layout)}) " if layout.cp > 1 else ""
    experts = f" (experts: EP {layout.ep} x EDP {layout.edp})" if layout.ep > 1 else ""
    return f"TP {layout.tp} x PP {layout.pp}{chunks} {cp}x DP {layout.dp}{experts}"


class MetricsFile:
    """``--metrics-out``: one JSON object per line, ``{"type": "run" | "step" | "eval" | "event" | "memory", ...}``,
    appended (a resumed run adds to the file) and flushed line by line: what a killed run logged stays."""

    def __init__(self, path: str) -> None:
        try:
            self.file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (closed by close, or at exit)
            if self.file.tell():  # a run killed mid-line left the last one unfinished: start on a line of our own
                self.file.seek(self.file.tell() - 1)
                if self.file.read(1) != "\n":
                    self.file.write("\n")
        except OSError as error:
            raise UsageError(
                f"--metrics-out {path}: cannot write it ({error.strerror}); give a file in a writable directory"
            ) from None

    def write(self, kind: str, record: dict) -> None:
        """Append one JSON record of ``kind`` and flush, so a crash keeps it."""
        self.file.write(json.dumps({"type": kind, **record}) + "\n")
        self.file.flush()

    def close(self) -> None:
        """Close the file."""
        self.file.close()


class RunSummary:
    """What the run's closing lines say: the steps and tokens this attempt trained, its time, the first, last and
    best loss (and validation loss), and where the last checkpoint is, with the command that exports it."""

    def __init__(self, *, start: int, clock=time.perf_counter) -> None:
        self.clock, self.started = clock, clock()
        self.start, self.steps, self.tokens, self.last_step = start, 0, 0, None  # steps and tokens: all that ran
        self.first = self.last = self.best = self.best_eval = None  # (step, loss)

    def step(self, m: StepMetrics) -> None:
        """Add a step to the summary."""
        self.steps, self.tokens, self.last_step = self.steps + 1, self.tokens + m.tokens, m.step
        if math.isfinite(m.loss):  # a skipped step's loss is NaN
            self.last = (m.step, m.loss)
            self.first = self.first or self.last
            if self.best is None or m.loss < self.best[1]:
                self.best = self.last

    def evaluated(self, step: int, loss: float) -> None:
        """Keep the best evaluation loss and its step."""
        if math.isfinite(loss) and (self.best_eval is None or loss < self.best_eval[1]):
            self.best_eval = (step, loss)

    def lines(self, *, checkpoint: str | None, save: str | None) -> list[str]:
        """The end-of-run summary: steps, time, losses, best eval and where the checkpoint is."""
        seconds = self.clock() - self.started
        minutes, rest = divmod(round(seconds), 60)
        took = f"{minutes} min {rest:02d} s" if minutes else f"{seconds:.1f} s"
        end = self.start + self.steps - 1 if self.last_step is None else self.last_step
        redone = self.steps - (end - self.start + 1)  # a --spike-guard rollback runs steps again
        text = (
            f"megakit: done: steps {self.start} to {end}{f' ({redone} redone after a rollback)' if redone else ''}"
            f", {self.tokens:,} tokens in {took} of training"
        )
        if self.last is not None:
            text += (
                f" | loss {self.first[1]:.4f} at step {self.first[0]} -> {self.last[1]:.4f} at step "
                f"{self.last[0]}, best {self.best[1]:.4f} at step {self.best[0]}"
            )
        if self.best_eval is not None:
            text += f" | best val loss {self.best_eval[1]:.4f} after {self.best_eval[0]} steps"
        if checkpoint is None:
            return [text + (" | no checkpoint (no --save)" if not save else "")]
        out = f"{save.rstrip('/')}-hf"
        return [
            text,
            f"megakit: last checkpoint {checkpoint}; export it to transformers with: "
            f"megakit convert {save} {out} --to-hf",
        ]


class Reporter:
    """Rank 0's progress bar, per-step log lines, TensorBoard events and metrics file."""

    def __init__(self, run, topo) -> None:
        cfg, start = run.cfg, run.start_step
        self.cfg, self.active = cfg, topo.rank == 0
        self.bar = self.writer = self.heartbeat = self.metrics = None
        self.summary = RunSummary(start=start)
        if not self.active:
            return
        if cfg.metrics_out:
            self.metrics = MetricsFile(cfg.metrics_out)
            self.metrics.write(
                "run",
                {
                    "start_step": start,
                    "steps": cfg.steps,
                    "model": str(cfg.model),
                    "world_size": dist.get_world_size(),
                    "time": time.time(),
                },
            )
        options = "".join(
            [
                ", sequence parallel" if run.sequence_parallel else "",
                ", compiled blocks" if run.compile else "",
                f", attention kernel {run.attention.name}" if run.attention.name != "auto" else "",
                f", {cfg.recompute} recompute" if cfg.recompute != "none" else "",
                f", loss in {run.loss_chunks} chunks" if run.loss_chunks > 1 else "",
                f", fp8 {cfg.fp8}" if cfg.fp8 != "none" else "",
                f", resuming {run.checkpoint} at step {start}" if start else "",
            ]
        )
        print(
            f"megakit: training {cfg.model} on {dist.get_world_size()} process(es): "
            f"{layout_words(topo.layout, vpp=cfg.vpp)}{options}",
            flush=True,
        )
        if run.lr_schedule:
            print(run.lr_schedule, flush=True)
        self.bar = progress_bar(cfg.steps, start) if cfg.progress else None
        if self.bar is None and cfg.log_heartbeat_s > 0:
            self.heartbeat = Heartbeat(cfg.log_heartbeat_s, step=start)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(cfg.tensorboard)

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def log(self, m: StepMetrics) -> None:
        """Log a step: the line every ``--log-every`` steps, the metrics file and TensorBoard."""
        if not self.active:
            return
        self.summary.step(m)
        if m.step % self.cfg.log_every == 0 or m.step == self.cfg.steps - 1:
            self._print(m.line())
        if self.heartbeat is not None:
            self.heartbeat.beat(m.step + 1)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{m.loss:.3f}", lr=f"{m.lr:.1e}")
        if self.writer is not None:
            for name, value in m.scalars().items():
                self.writer.add_scalar(name, value, m.step)
        if self.metrics is not None:
            self.metrics.write("step", m.to_dict())

    def event(self, step: int, kind: str, text: str, **numbers: float) -> dict:
        """One line for an intervention (a skipped step), its numbers in TensorBoard; returns its metrics record."""
        record = {"step": step, "kind": kind, "text": text, **numbers}
        if self.active:
            self._print(f"megakit: {text}")
            if self.writer is not None:
                for name, value in numbers.items():
                    self.writer.add_scalar(f"guard/{name}", value, step)
            if self.metrics is not None:
                self.metrics.write("event", record)
        return record

    def eval(self, step: int, loss: float, sources: dict | None = None) -> dict:
        """Log a validation loss (console, TensorBoard), and a mixture's per data set; returns the record the
        metrics file keeps."""
        from megakit.train.observe.evaluate import perplexity

        record = {
            "step": step,
            "loss": loss,
            "perplexity": perplexity(loss),
            **({"sources": sources} if sources else {}),
        }
        if self.active:
            self.summary.evaluated(step, loss)
            each = "".join(f" | {name} {value:.4f}" for name, value in (sources or {}).items())
            self._print(f"eval after {step} steps | val loss {loss:.4f} | perplexity {record['perplexity']:.2f}{each}")
            if self.writer is not None:
                self.writer.add_scalar("val/loss", loss, step)
                self.writer.add_scalar("val/perplexity", record["perplexity"], step)
                for name, value in (sources or {}).items():
                    self.writer.add_scalar(f"val/loss/{name}", value, step)
            if self.metrics is not None:
                self.metrics.write("eval", record)
        return record

    def compiled(self, m: StepMetrics) -> None:
        """Say that step ``m`` paid for compiling, apart from the throughput of the steps after it."""
        if self.active:
            self._print(
                f"megakit: compile: step {m.step} took {m.seconds:.1f} s including torch.compile of the "
                "blocks; throughput counts from the next step"
            )

    def attention_kernels(self, profiler) -> None:
        """Name the attention kernels the profiler saw (``--profile``), so a run shows which SDPA backend ran."""
        names = getattr(profiler, "attention_kernels", None)
        if self.active and names is not None:
            self._print(f"megakit: attention kernels in the profile: {', '.join(names) or 'none (written out)'}")

    def memory(self, rows: list) -> None:
        """Print the memory table (measured against predicted)."""
        if self.active:
            from megakit.train.observe.memory_probe import format_table

            self._print(format_table(rows))
            if self.metrics is not None:
                self.metrics.write("memory", {"rows": rows})

    def close(self, *, checkpoint: str | None = None) -> None:
        """The closing summary (``checkpoint``: the last one the run saved), then the bar, TensorBoard, metrics."""
        if not self.active:
            return
        for line in self.summary.lines(checkpoint=checkpoint, save=self.cfg.save):
            self._print(line)
        if self.bar is not None:
            self.bar.close()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.writer is not None:
            self.writer.close()
        if self.metrics is not None:
            self.metrics.close()
