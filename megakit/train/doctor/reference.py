"""The single-process run a distributed run must reproduce: same weights, data, optimizer, schedule, clipping.

Plain PyTorch, no DeepSpeed engine and no process group: the full model, every
micro-batch of every DP rank in turn, torch's AdamW with the ds_config's settings (and the trainer's
decay groups and schedule placement, ``megakit.train.engine.optim``),
the ds_config's LR scheduler class from ``deepspeed.runtime.lr_schedules`` and
``torch.nn.utils.clip_grad_norm_``. The equivalence tests compare the trainer's
loss trajectory against this; it is also the "shrink to one GPU and compare the
curves" check of the FAQ.
"""

from __future__ import annotations

import copy

import torch

from megakit.train.data.batches import DEFAULT_MAX_BYTES, BatchPlan, TokenBatches
from megakit.train.data.corpus import ValidationBatches, model_for_corpus, open_corpus
from megakit.train.engine.ds_config import schedule_over_steps
from megakit.train.engine.optim import decay_groups, start_schedule


def reference_run(
    ds_config: dict,
    *,
    model: str,
    steps: int,
    dp: int = 1,
    seq_len: int | None = None,
    seed: int = 0,
    data: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    eval_every: int = 0,
    eval_batches: int = 8,
    moe: dict | None = None,
    documents: dict | None = None,
    mtp: dict | None = None,
    weights: bool = False,
    lora: dict | None = None,
) -> dict[str, list]:
    """``{"loss": [...], "grad_norm": [...], "lr": [...], "evals": [...]}`` of ``steps`` steps of the unsplit model.

    ``ds_config`` is the dict the trainer used (micro-batch and accumulation per rank);
    ``dp`` is the distributed run's DP size, so the global batch is the same. With ``eval_every``, ``evals``
    holds ``{"step", "loss"}`` where the trainer evaluates: the mean loss, in eval mode, over the tokens of every
    micro-batch of ``eval_batches`` validation batches. ``moe``: the ``TrainConfig`` ``moe_*`` flags
    (``moe_aux_loss=...``); ``documents``: the packed-document flags (``reset_attention_mask=True``, ...); ``mtp``:
    the MTP flags (``mtp=True, mtp_weight=...``); ``lora``: a ``LoraSpec``'s fields and the ``base`` checkpoint;
    ``weights``: also the final ``state_dict`` (``"weights"``). The
    loss is sum(loss) / sum(tokens) over each step's global batch (as ``token_weighting`` makes the trainer's);
    an MoE model's balancing losses are scaled 1 / micro-batches and its expert bias moves once per step.
    """
    from deepspeed.runtime import lr_schedules

    from megakit.nn.model import ModelConfig, Transformer, set_loss_tokens
    from megakit.nn.moe.layer import set_aux_loss_scale, update_expert_bias
    from megakit.nn.mtp import depth_token_counts
    from megakit.train.run import TrainConfig, with_moe_flags

    corpus = open_corpus(data, max_bytes=max_bytes)
    config = model_for_corpus(ModelConfig.load(model), model, corpus)
    cfg = TrainConfig(ds_config=ds_config, model=model, **(moe or {}), **(documents or {}), **(mtp or {}))
    config = with_moe_flags(config, cfg)
    net = _adapted(Transformer(config, seed=seed, mtp=cfg.mtp, mtp_weight=cfg.mtp_weight), config, lora, seed)
    depths = len(net.mtp)
    seq_len = seq_len or config.max_seq_len
    plan = BatchPlan(
        seq_len=seq_len,
        micro_batch=ds_config["train_micro_batch_size_per_gpu"],
        accumulation=ds_config.get("gradient_accumulation_steps", 1),
        dp=dp,
        seed=seed,
    )
    batches = TokenBatches(corpus.train, plan, **corpus.loader_options(cfg))
    params = {k: v for k, v in ds_config["optimizer"]["params"].items() if k not in ("torch_adam", "adam_w_mode")}
    optimizer = torch.optim.AdamW(decay_groups(net), **params)
    ds_config = copy.deepcopy(ds_config)  # the caller's stays as it was
    schedule_over_steps(ds_config, steps=steps)  # over the run's steps, as the trainer's
    scheduler = None
    if "scheduler" in ds_config:
        kind = ds_config["scheduler"]["type"]
        scheduler = getattr(lr_schedules, kind)(optimizer, **ds_config["scheduler"].get("params", {}))
        start_schedule(scheduler, 0)
    max_norm = float(ds_config.get("gradient_clipping", 0.0))
    out = {"loss": [], "grad_norm": [], "lr": [], "evals": [], "mtp": []}
    micro_count = plan.dp * plan.accumulation
    set_aux_loss_scale(net, 1.0 / micro_count)
    for step in range(steps):
        out["lr"].append(optimizer.param_groups[0]["lr"])
        total, depth_losses = 0.0, torch.zeros(depths, dtype=torch.float64)
        step_batches = [
            (batches.micro_batches(step, rank), batches.sample_numbers(step, rank), batches.forward_extras(step, rank))
            for rank in range(plan.dp)
        ]
        tokens = sum(
            depth_token_counts(labels, depths, more.get("documents")).double()  # the main's, each depth's
            for mbs, _, extras in step_batches
            for (_, labels), more in zip(mbs, extras)
        )
        set_loss_tokens(net, tokens.clamp(min=1).float())  # sum / sum over the whole global batch; no target: 0
        for micro_batches, numbers, extras in step_batches:
            for (inputs, labels), rows, more in zip(micro_batches, numbers, extras):
                loss = net(inputs, labels, sample_ids=rows, **more)
                loss.backward()
                total += float(loss.detach())
                depth_losses += torch.tensor([float(x) for x in net.mtp_losses], dtype=torch.float64)
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm if max_norm > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_bias(net)
        if scheduler is not None:
            scheduler.step()
        out["loss"].append(total)
        out["grad_norm"].append(float(norm))
        out["mtp"].append(depth_losses.tolist() if depths else None)  # each L_k: its sum over its own tokens
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            out["evals"].append(
                {"step": step + 1, "loss": _validation_loss(net, corpus.parts, plan, eval_batches, cfg)}
            )
    if weights:
        out["weights"] = {name: t.detach().clone() for name, t in net.state_dict().items()}
    return out


def _adapted(net, config, lora: dict | None, seed: int):
    """``net``, or with ``lora`` (a ``LoraSpec``'s fields, and ``base``: a checkpoint, else the seed's weights) its
    adapters on the frozen model."""
    if lora is None:
        return net
    from megakit.core.lora import LoraSpec
    from megakit.interop.checkpoint import load_checkpoint
    from megakit.nn.lora import add_lora

    fields = {k: v for k, v in lora.items() if k != "base"}
    add_lora(net, LoraSpec(**fields), config=config, seed=seed)
    if lora.get("base") is not None:
        load_checkpoint(lora["base"], net, base=True)
    return net


def _validation_loss(net, corpora, plan: BatchPlan, batches: int, cfg) -> float:
    """The mean loss over the valid tokens of every micro-batch of every DP rank of ``batches`` validation batches
    of each of ``corpora`` (a mixture's data sets, or the one corpus), in eval mode."""
    from megakit.nn.model import set_loss_tokens

    sets = [ValidationBatches(c, plan, batches, c.loader_options(cfg, "validation")) for c in corpora]
    net.eval()
    set_loss_tokens(net, None)
    with torch.no_grad():
        pairs = [
            (net(x, y, **more).double(), int((y != -100).sum()))
            for validation in sets
            for k in range(validation.batches)
            for rank in range(plan.dp)
            for (x, y), more in zip(validation.micro_batches(k, rank), validation.forward_extras(k, rank))
        ]
    net.train()
    return float(sum(loss * n for loss, n in pairs) / max(sum(n for _, n in pairs), 1))
