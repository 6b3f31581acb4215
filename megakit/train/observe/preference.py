"""A preference run (``--objective dpo|ipo|simpo``) around the training loop: the reference pass, each micro-batch's
reference log-probabilities, the step's weighting by pairs and the TRL-named metrics.

The reference is the frozen starting model: one forward pass over every training window before the first step
(the evaluation's forward: eval mode, no gradients, the pipeline's stages in order), each sequence's summed
completion log-probability kept per window. It is stored beside the run, ``SAVE.reference-logps.npz`` next to the
``--save`` directory (a checkpoint replaces that directory whole, so the file sits outside it), with the data's
fingerprint and window; a resume or a relaunch reads it back, and a resume without it is an error, since the
loaded weights are no longer the start. Without ``--save`` it is computed and kept in memory. SimPO needs none.

The loss of a step is the mean over its pairs: each micro-batch's summed pair losses are divided by
``P / (GA x DP)``, P the step's pairs over every DP replica, as ``token_weighting`` does with tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from megakit.errors import UsageError
from megakit.nn import comm
from megakit.nn.model import Transformer, set_loss_tokens, set_preference
from megakit.nn.tensor_parallel.preference import STATS, Preference, count_pairs
from megakit.train.observe.evaluate import _forward_pipeline


def reference_path(save: str | None) -> Path | None:
    """Where a run saving to ``save`` keeps its reference log-probabilities (None without --save)."""
    return None if not save else Path(save).parent / f"{Path(save).name}.reference-logps.npz"


def reference_stamp(run, *, windows: int, slots: int) -> tuple[dict, dict]:
    """``(data, stamp)``: what the stored log-probabilities are of. ``data``: the corpus, window and slots (a resume
    checks these); ``stamp`` adds the start's weights (a fresh start reuses the file only from the same ones): the
    model, seed, the checkpoint it loads, and under LoRA the frozen base the adapters start on."""
    data = {"corpus": run.corpus.fingerprint, "seq_len": run.batch.seq_len, "windows": windows, "slots": slots}
    start = {"model": run.cfg.model, "seed": run.cfg.seed, "from": str(run.checkpoint)}
    if getattr(run, "lora_base", None) is not None:  # --lora-base B (or --load B of a base): the reference is B's
        start["lora_base"] = str(run.lora_base)
    return data, {**data, "start": start}


def _losses(module) -> list[Transformer]:
    return [m for m in module.modules() if isinstance(m, Transformer) and m.post]


class PreferenceRun:
    """``extras`` adds each micro-batch's ``reference``; ``weight`` sets the divisor; ``after_step`` -> metrics."""

    def __init__(self, run, topo, engine, batches, device) -> None:
        cfg = run.cfg
        self.topo, self.batches, self.device, self.slots = topo, batches, device, run.corpus.pairs
        self.preference = Preference(
            objective=cfg.objective,
            beta=cfg.dpo_beta,
            label_smoothing=cfg.label_smoothing,
            gamma=0.5 if cfg.simpo_gamma is None else cfg.simpo_gamma,
        )
        self.modules = [engine] if cfg.vpp == 1 else list(engine.module)
        self.losses = _losses(engine.module)
        set_preference(engine.module, self.preference)
        self.reference = None
        if self.preference.needs_reference:
            self.reference = self._stored_or_computed(run, engine)

    # -- the reference ------------------------------------------------------------------------
    def _stored_or_computed(self, run, engine) -> torch.Tensor:
        path = reference_path(run.cfg.save)
        data, stamp = reference_stamp(run, windows=self.batches.num_samples, slots=self.slots)
        if path is not None and path.is_file():
            with np.load(path) as stored:
                kept = json.loads(str(stored["stamp"]))
                same = kept == stamp if run.start_step == 0 else {k: kept.get(k) for k in data} == data
                if same:
                    return torch.from_numpy(stored["logps"].copy())
            if run.start_step > 0:
                raise UsageError(
                    f"{path} holds the reference log-probabilities of other data or windows; the run resumes from "
                    "trained weights, which are no longer the reference: resume with the data it started on"
                )
        elif run.start_step > 0 and path is not None:
            raise UsageError(
                f"the run resumes at step {run.start_step} but {path} (the reference log-probabilities of the "
                "starting model) is missing; restore it, or start the run again with --init from the start"
            )
        logps = self._reference_pass(run, engine)
        if path is not None and self.topo.rank == 0:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
            try:
                np.savez(tmp, logps=logps.numpy(), stamp=np.array(json.dumps(stamp)))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        return logps

    def _reference_pass(self, run, engine) -> torch.Tensor:
        """Every training window's sequence log-probabilities ``(windows, slots)`` under the model as it is now."""
        from megakit.nn.pipeline.executor import activation_shape

        plan, topo, batches = run.batch, self.topo, self.batches
        total = batches.num_samples
        rounds = -(-total // plan.global_batch)
        out = torch.zeros(rounds * plan.global_batch, self.slots, dtype=torch.float64, device=self.device)
        shape = activation_shape(
            run.model,
            micro_batch_size=plan.micro_batch,
            seq_len=plan.seq_len // topo.cp,
            tp=topo.tp,
            sequence_parallel=run.sequence_parallel,
        )
        holds = topo.is_last_stage and topo.tp_rank == 0 and topo.cp_rank == 0
        was_training = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
        set_loss_tokens(engine.module, None)
        try:
            with torch.no_grad():
                per_rank = plan.micro_batch * plan.accumulation
                for r in range(rounds):
                    first = r * plan.global_batch + topo.dp_rank * per_rank
                    positions = torch.arange(first, first + per_rank)
                    inputs, labels = batches._samples(positions % total)
                    docs = batches._documents(positions % total)
                    for k in range(plan.accumulation):
                        rows = slice(k * plan.micro_batch, (k + 1) * plan.micro_batch)
                        x, y = inputs[rows].to(self.device), labels[rows].to(self.device)
                        extras = {"documents": docs[rows].to(self.device)}
                        if batches.reset_positions:
                            from megakit.nn.attention.masks import position_ids

                            extras["position_ids"] = position_ids(extras["documents"])
                        extras["reference"] = torch.zeros(x.shape[0], self.slots, device=self.device)
                        if topo.pp == 1:
                            self.modules[0](x, y, **extras)
                        else:
                            _forward_pipeline(
                                self.modules, topo, x, y, extras, shape=shape, dtype=run.dtype, device=self.device
                            )
                        if holds:
                            at = positions[rows].to(self.device)
                            out[at] = self.losses[-1].sequence_logps.double()
        finally:
            for m, mode in zip(self.modules, was_training):
                m.train(mode)
            for m in self.losses:
                m.preference_stats = None
        comm.all_reduce(out, comm.WORLD)  # one holder per DP replica and row
        return out[:total].float().cpu()

    # -- each step ----------------------------------------------------------------------------
    def extras(self, step: int, dp_rank: int, extras: list[dict]) -> list[dict]:
        """Each micro-batch's forward keywords with its rows' reference (zeros for SimPO: only its width is read)."""
        rows = self.batches.rank_indices(step, dp_rank)
        if self.reference is None:
            table = torch.zeros(len(rows), self.slots)
        else:
            table = self.reference[rows]
        parts = table.split(self.batches.plan.micro_batch)
        return [{**e, "reference": p.to(self.device)} for e, p in zip(extras, parts)]

    def weight(self, module, micro_batches) -> None:
        """Every micro-batch's summed pair losses over the step's ``P / (GA x DP)``; one all-reduce of one number."""
        topo = self.topo
        count = sum(count_pairs(y, extras["documents"], self.slots) for _, y, _, extras in micro_batches).double()
        if topo.dp * topo.cp > 1:
            comm.all_reduce(count, topo.get_data_parallel_group())
        pairs = (count / topo.cp).clamp(min=1)
        set_loss_tokens(module, (pairs / (len(micro_batches) * topo.dp)).float())

    def after_step(self) -> dict[str, float]:
        """The step's TRL metrics (means over its pairs), the same on every rank: one all-reduce over the job."""
        sums = torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        for m in self.losses:
            if m.preference_stats is not None and m.training:
                sums += m.preference_stats.to(sums.device)
            m.preference_stats = None
        total = comm.all_reduce(sums, comm.WORLD).cpu()  # TP x CP copies of each replica: the ratios cancel them
        pairs = total[0].clamp(min=1)
        return {name: float(v / pairs) for name, v in zip(STATS[1:], total[1:])}


def check_pairs(corpus, cfg) -> None:
    """One line for a pair objective on data without pairs, or without each sequence as its own document."""
    if cfg.objective == "lm":
        return
    if corpus.pairs is None:
        raise UsageError(
            f"--objective {cfg.objective} trains on preference pairs, and {corpus.source} holds none; prepare rows "
            "with 'chosen' and 'rejected' with megakit prepare-data --pack N (or --pad N) and pass that directory"
        )
    if cfg.eval_every:
        raise UsageError(f"--objective {cfg.objective} has no validation loss yet; drop --eval-every")
