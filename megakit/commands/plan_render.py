"""The human-readable ``megakit plan`` report: rich tables built from the JSON report."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

MEMORY_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "master_params": "fp32 master params",
    "optimizer": "Adam moments (m, v)",
    "muon_momentum": "Muon momentum (one fp32 per hidden-matrix weight)",
    "fp32_step_grads": "fp32 grads at step (in the activations' place)",
    "expert_params": "experts: params (E/EP per GPU)",
    "expert_grads": "experts: gradients (ZeRO-2: over EDP)",
    "expert_master_params": "experts: fp32 master params (ZeRO over EDP)",
    "expert_optimizer": "experts: Adam moments (ZeRO over EDP)",
    "expert_muon_momentum": "experts: Muon momentum (ZeRO over EDP)",
    "muon_step": "Muon step: updates, exchange buffers, Newton-Schulz (in the activations' place)",
    "activations": "activations",
    "moe_routing": "MoE routing (router logits, top-k, aux-loss terms, dispatch, expert acts)",
    "pipeline_outputs": "stage outputs kept for backward",
    "weight_grad_inputs": "kept for deferred W (ZB-H1)",
    "recompute_working_set": "recompute working set",
    "logits": "logits + loss (last stage)",
    "comm_buffers": "communication buckets",
    "zero3_gather": "ZeRO-3 gather buffers",
    "overhead": "CUDA context / workspaces",
    "lora_params": "LoRA adapters: params",
    "lora_grads": "LoRA adapters: gradients",
    "lora_master_params": "LoRA adapters: fp32 master params",
    "lora_optimizer": "LoRA adapters: Adam moments (m, v)",
    "lora_activations": "LoRA: kept rank-r intermediates (and dropped/gathered inputs)",
}


def _short(p: dict) -> str:
    cp = f" CP={p['cp']}" if p.get("cp", 1) > 1 else ""
    text = f"TP={p['tp']}{cp} PP={p['pp']} DP={p['dp']}" + (f" EP={p['ep']}" if p.get("ep", 1) > 1 else "")
    if p["vpp"] > 1:
        text += f" VPP={p['vpp']}"
    text += f" ZeRO-{p['zero_stage']} mb={p['micro_batch']}x{p['grad_accum']} rc={p['recompute']}"
    return text + (" SP" if p["sequence_parallel"] else "")


def _count(n: float) -> str:
    """A parameter count as docs/models.md writes it: 61K, 124.4M, 174.62B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _zero_stage(p: dict) -> str:
    """The stage, and HSDP's shard group where ZeRO-3 shards inside groups smaller than DP x CP."""
    group, ranks = p.get("zero3_shard_group"), p["dp"] * p.get("cp", 1)
    if group and group < ranks:
        return f"{p['zero_stage']} (HSDP: states sharded over {group} GPUs, replicated {ranks // group}x)"
    return str(p["zero_stage"])


def _layers_row(p: dict) -> tuple:
    """The blocks of each virtual stage in pipeline order, runs written once (3, 4 x 30, 3), when there is a
    pipeline."""
    if p["pp"] == 1:
        return ()
    runs: list[list[int]] = []
    for count in p["stage_layers"]:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    text = ", ".join(str(c) if n == 1 else f"{c} x {n}" for c, n in runs)
    return (("layers per virtual stage", f"{text} ({sum(p['stage_layers'])} in all)"),)


def render(
    report: dict, result, model, cluster, *, tips: list, emitted: str | None, launch: str, launch_note: str = ""
) -> None:
    """``megakit plan``'s tables, from the report its ``--json`` prints: one section per function, in order."""
    console = Console(highlight=False)
    a, p = report["assumptions"], report["plan"]
    _print_assumptions(console, a)
    _print_plan(console, a, p)
    _print_memory(console, a, p)
    _print_speed(console, a, p)
    _print_others(console, report, p)
    console.print("[bold]Tips[/]")
    for tip in tips:
        console.print(f"  - {tip}")
    if emitted:
        console.print(f"[bold]Wrote[/] {emitted}. Launch:")
    else:
        console.print("[bold]Launch[/] (write the config with --emit-config PATH):")
    console.print(f"  {launch}", soft_wrap=True)
    if launch_note:
        console.print(f"  ({launch_note}; the memory and speed above count on them)")


def _print_assumptions(console, a: dict) -> None:
    """The model, the cluster, the rule the search started from and the batch: what the plan assumed."""
    m, c = a["model"], a["cluster"]
    console.print(f"[bold]Model[/]: {m['source']}")
    console.print(
        f"  {m['family']}: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads"
        f"{' (' + str(m['kv_heads']) + ' KV)' if m['kv_heads'] != m['heads'] else ''}, FFN {m['ffn']}, "
        f"vocab {m['vocab']}, seq {m['seq_len']}: {_count(m['params'])} parameters"
    )
    if "moe" in a:
        e = a["moe"]
        console.print(
            f"  MoE: {e['experts']} experts of FFN {e['expert_ffn']}, top-{e['top_k']}"
            f"{', shared FFN ' + str(e['shared_ffn']) if e['shared_ffn'] else ''}, in {e['moe_layers']} "
            f"of {m['layers']} layers: {m['params'] / 1e9:.2f}B total, {e['active_params'] / 1e9:.2f}B "
            f"active per token"
        )
        console.print(f"  Routing priced: {e['routing']} ({e['routing_note']}).")
    console.print(
        f"[bold]Cluster[/]: {c['num_gpus']} x {c['gpu']} ({c['nodes']} node(s) x {c['gpus_per_node']}), "
        f"{c['gpu_memory_gib']:,.4g} GiB, {c['peak_tflops']:,.4g} TFLOP/s peak; "
        f"intra-node {c['intra_node']}; "
        f"inter-node {c['inter_node']}"
    )
    if c["auto_sized"]:
        console.print(
            f"  No --gpus/--nodes given: planned for the smallest whole number of nodes on which "
            f"training fits: [bold]{c['nodes']} nodes ({c['num_gpus']} GPUs)[/]."
        )
    console.print(f"[bold]Rule[/] ({a['rule']['branch']}): {a['rule']['why']}.")
    if a.get("global_batch_note") and a["global_batch_note"] != "--global-batch":
        console.print(f"[bold]Global batch[/] (no --global-batch given): {a['global_batch_note']}.")


def _print_plan(console, a: dict, p: dict) -> None:
    """The layout: the parallel degrees, the experts' groups, the schedule, ZeRO, batch and precision."""
    plan = Table(title="Plan", show_header=False)
    grid = (
        ("TP x CP x PP x DP", f"{p['tp']} x {p['cp']} x {p['pp']} x {p['dp']} = {p['num_gpus']} GPUs")
        if p.get("cp", 1) > 1
        else ("TP x PP x DP", f"{p['tp']} x {p['pp']} x {p['dp']} = {p['num_gpus']} GPUs")
    )
    span = p.get("ep_group")
    moe = (
        (
            (
                "experts: EP x EDP",
                f"{p['ep']} x {p['edp']} (E/EP experts per GPU; EP folded over TP x CP x DP, "
                f"attention on TP x CP x DP)",
            ),
            *(
                (
                    (
                        "EP group (all-to-all)",
                        f"{span['ranks']} consecutive ranks, {span['tp_groups']} TP group(s), {span['link']}",
                    ),
                )
                if span
                else ()
            ),
        )
        if "moe" in a
        else ()
    )
    cp_mode = (("context parallelism", p["cp_mode_note"]),) if p.get("cp_mode_note") else ()
    for key, value in (
        grid,
        *cp_mode,
        *moe,
        ("virtual stages", p["vpp"]),
        *_layers_row(p),
        ("schedule", p.get("schedule", "1f1b")),
        ("ZeRO stage", _zero_stage(p)),
        (
            "batch",
            f"micro {p['micro_batch']} x accumulation {p['grad_accum']} x DP {p['dp']} = {p['global_batch']} sequences",
        ),
        ("recompute", p["recompute"]),
        ("sequence parallel", p["sequence_parallel"]),
        ("precision / attention", f"{p['precision']} / {a['attention']}"),
        ("kernels / fp8", f"{p['kernels']} / {p['fp8']}"),
    ):
        plan.add_row(key, str(value))
    console.print(plan)


def _print_memory(console, a: dict, p: dict) -> None:
    """The peak stage's memory item by item against the line, and the verdict of a pinned layout."""
    limit = a["mem_threshold"] * p["gpu_memory_gib"]
    mem = Table(title=f"Memory per GPU (stage {p['peak_stage']}, the peak)")
    mem.add_column("item")
    mem.add_column("GiB", justify="right")
    for key, gib in p["memory"].items():
        if gib > 0.0005:
            mem.add_row(MEMORY_LABELS.get(key, key), f"{gib:.2f}")
        elif key == "moe_routing" and "moe" in a:  # shown even when full recompute drops it
            mem.add_row(MEMORY_LABELS[key], f"{gib:.2f} (recomputed)" if p["recompute"] == "full" else f"{gib:.2f}")
        for line, part in p.get("memory_breakdown", {}).get(key, {}).items():  # inside the item, one line each
            mem.add_row(f"  of which {line}", f"{part:.2f}")
    mem.add_row("[bold]peak[/]", f"[bold]{p['peak_memory_gib']:.2f}[/]")
    mem.add_row(f"{a['mem_threshold']:.0%} line", f"{limit:.2f}")
    mem.add_row("headroom to the line", f"{limit - p['peak_memory_gib']:.2f}")
    console.print(mem)
    if p.get("lora"):
        lora = p["lora"]
        console.print(
            f"[bold]LoRA[/] rank {lora['rank']} on {', '.join(lora['targets'])}: {_count(lora['adapter_params'])} "
            f"adapter parameters ({lora['adapter_share']:.2%} of the model); {lora['why']}."
        )
    if p.get("fits") == "above_threshold":
        console.print(f"[bold yellow]Fits: above the line[/]: {p['headroom']}.")
    elif a["rule"]["branch"] == "pinned":
        console.print(f"[bold]Fits[/]: yes, under the {a['mem_threshold']:.0%} line.")


def _print_speed(console, a: dict, p: dict) -> None:
    """The predicted step time, throughput, MFU and where the time goes."""
    speed = Table(title="Throughput (predicted)", show_header=False)
    rows = [
        ("step time", f"{p['step_time_s']:.2f} s"),
        ("tokens/s", f"{p['tokens_per_s']:,.0f}"),
        ("model TFLOP/s per GPU (full S x S attention)", f"{p['model_tflops_per_gpu']:.0f}"),
        (
            "GFLOP per token (causal attention, windows counted)",
            f"{p['gflops_per_token']['causal']:.1f}"
            + (
                f" ({p['gflops_per_token']['windows_ignored']:.1f} if the windows were ignored)"
                if p["gflops_per_token"]["causal"] != p["gflops_per_token"]["windows_ignored"]
                else ""
            ),
        ),
        ("hardware TFLOP/s per GPU (as executed: recompute, causal flash half)", f"{p['hardware_tflops_per_gpu']:.0f}"),
        ("MFU (model FLOPs, PaLM's convention)", f"{p['mfu']:.1%}"),
        ("communication share", f"{p['comm_fraction']:.1%}"),
        ("pipeline bubble", f"{p['bubble_fraction']:.1%}"),
        *(
            (
                (
                    "MoE all-to-all (dispatch + combine)",
                    f"{p['all_to_all_s']:.2f} s per step, {p['all_to_all_fraction']:.1%} of it",
                ),
            )
            if "moe" in a
            else ()
        ),
        ("speed-up vs one GPU", f"{p['speedup_vs_one_gpu']:.1f}x (scaling efficiency {p['scaling_efficiency']:.0%})"),
    ]
    if "train_days" in p:
        rows.append((f"time to train {a['tokens'] / 1e9:g}B tokens", f"{p['train_days']:.1f} days"))
    for key, value in rows:
        speed.add_row(key, value)
    console.print(speed)


def _print_others(console, report: dict, p: dict) -> None:
    """The fastest alternatives and the rejected layouts, each with why not."""
    if report["alternatives"]:
        alt = Table(title="Top alternatives")
        for col in ("layout", "peak GiB", "tokens/s", "vs plan"):
            alt.add_column(col, justify="left" if col == "layout" else "right")
        for q in report["alternatives"]:
            alt.add_row(
                _short(q),
                f"{q['peak_memory_gib']:.1f}",
                f"{q['tokens_per_s']:,.0f}",
                f"{q['tokens_per_s'] / p['tokens_per_s']:.0%}",
            )
        console.print(alt)
    if report["rejected"]:
        rej = Table(title="Rejected")
        rej.add_column("layout")
        rej.add_column("would do tok/s", justify="right")
        rej.add_column("why not")
        for r in report["rejected"]:
            q = r["plan"]
            if r["kind"] == "memory":
                layout = _short(q)
            elif r["kind"] in ("floor", "zero-pp", "batch"):
                layout = f"TP={q['tp']} PP={q['pp']} DP={q['dp']} ZeRO-{q['zero_stage']}"
            elif r["kind"] == "ep":
                layout = f"TP={q['tp']} PP={q['pp']} DP={q['dp']} EP={q['ep']}"
            else:
                layout = f"TP={q['tp']} PP={q['pp']}"
            speed_text = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
            rej.add_row(layout, speed_text, r["reason"])
        console.print(rej)
