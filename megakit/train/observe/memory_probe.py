"""``--verify-memory``: each rank's measured memory next to the planner's prediction for the same layout.

GPU: ``torch.cuda.max_memory_allocated`` against the planner's total. CPU has no
allocator statistics, so the bytes are counted from the objects that hold them:

- model states: the storages reachable from the stage's parameters and the DeepSpeed
  optimizer (flat buffers, fp32 master partitions, Adam moments, gradient partitions),
  each storage counted once, classified by what holds it, sampled after every
  backward, just before and just after ``optimizer.step`` (largest value per item);
- activations: every tensor autograd saves for backward passes through
  ``torch.autograd.graph.saved_tensors_hooks``; its storage is counted while the
  graph holds it (parameters and buffers excluded), and the peak over the step is reported, so
  a pipeline's micro-batches in flight count as they overlap; of them, those saved from the
  final norm to the loss are the ``logits`` item as well (the planner's ``logits_bytes``,
  its transient logits left out).

The planner (``megakit.core.planner.memory.estimate_memory``) gets the same stage, split of the layers,
micro-batch, sequence length, accumulation, ZeRO stage and precision.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from megakit.nn import comm

ITEMS = ("params", "grads", "master_params", "optimizer")  # the model states compared within 2 %
_GRAD_BUFFERS = (
    "grads_in_partition",
    "all_grad_tensors",
    "averaged_gradients",
    "grad_partitions_flat_buffer",
    "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
)
_COMM_BUFFERS = ("ipg", "bucket")
_MASTER = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat")


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Census:
    """Bytes found in one sample: per storage, the union of the byte ranges that tensors use,
    each storage assigned to the first item that claims it.

    Ranges, not whole storages: DeepSpeed's ZeRO-2 gradients are views into a reduce
    bucket of ``reduce_bucket_size`` elements, which is a communication buffer.
    """

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.ranges: dict[int, list[tuple[int, int]]] = {}

    def add(self, item: str, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
            return
        ptr = t.untyped_storage().data_ptr()
        if not ptr or self.owner.setdefault(ptr, item) != item:
            return
        start = t.storage_offset() * t.element_size()
        self.ranges.setdefault(ptr, []).append((start, start + t.numel() * t.element_size()))

    @property
    def bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ptr, ranges in self.ranges.items():
            total, end = 0, -1
            for a, b in sorted(ranges):
                if b > end:
                    total += b - max(a, end)
                    end = b
            out[self.owner[ptr]] = out.get(self.owner[ptr], 0) + total
        return out

    def walk(self, item: str, obj, depth: int = 0) -> None:
        if depth > 4:
            return
        if isinstance(obj, torch.Tensor):
            self.add(item, obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                self.walk(item, v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                self.walk(item, v, depth + 1)
        elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
            for v in vars(obj).values():  # e.g. ZeRO-3's IPG bucket objects
                self.walk(item, v, depth + 1)


class MemoryProbe:
    """Samples one rank's model-state and activation bytes during a few training steps."""

    def __init__(self, engine, topo, run) -> None:
        self.engine, self.topo, self.run = engine, topo, run
        self.peak = {k: 0 for k in ITEMS + ("fp32_step_grads", "comm_buffers", "zero3_gather")}
        self.activation_peak = 0
        self._live: dict[int, list] = {}  # storage -> [bytes, references, saved by the head and loss]
        self._live_bytes = 0
        self.logits_peak, self._logits_bytes, self._in_head = 0, 0, False
        # parameters and buffers (RoPE tables a block saves a slice of) are the model's memory, not activations
        self._params = {_storage(p)[0] for p in [*engine.module.parameters(), *engine.module.buffers()] if p.numel()}
        self.counting = not torch.cuda.is_available()  # a GPU's allocator counts for us (see row)
        if not self.counting:
            return
        wrapper = engine.optimizer
        basic = getattr(wrapper, "optimizer", wrapper)
        basic.register_step_pre_hook(lambda *_: self.sample(pre_step=True))
        basic.register_step_post_hook(lambda *_: self.sample())
        for p in engine.module.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: self.sample())
        for chunk in self._chunks():  # from the final norm to the loss: the head's saved tensors
            if chunk.post:
                chunk.norm.register_forward_pre_hook(lambda *_: setattr(self, "_in_head", True))
                chunk.register_forward_hook(lambda *_: setattr(self, "_in_head", False))
            if len(getattr(chunk, "mtp", ())):  # an MTP module, from its embedding lookup on, is a block's (the
                chunk.embed.register_forward_pre_hook(lambda *_: setattr(self, "_in_head", False))  # planner's
                for module in chunk.mtp:  # activations); its head and loss after it are the head's again
                    module.register_forward_hook(lambda *_: setattr(self, "_in_head", True))

    # -- model states ---------------------------------------------------------------------------
    def sample(self, *, pre_step: bool = False) -> None:
        """Count what each kind of state holds now (grads, master weights, moments) and keep the largest."""
        census = _Census()
        wrapper = self.engine.optimizer
        basic = getattr(wrapper, "optimizer", wrapper)
        for name, value in vars(wrapper).items():  # first: ZeRO-2/3 gradients sit in these buckets
            if any(key in name for key in _COMM_BUFFERS):
                census.walk("comm_buffers", value)
        for p in self.engine.module.parameters():  # ZeRO-3: the partition lives in ds_tensor
            if hasattr(p, "ds_tensor"):
                census.add("params", p.ds_tensor)
                census.add("zero3_gather", p)  # gathered for forward/backward, released after
            else:
                census.add("params", p)
        for name, value in vars(wrapper).items():
            if name in (
                "fp16_groups",
                "bit16_groups",
                "fp16_partitioned_groups",
                "fp16_partitioned_groups_flat",
                "bit16_groups_flat",
            ):
                census.walk("params", value)
        for p in self.engine.module.parameters():
            census.add("grads", p.grad)
        for name, value in vars(wrapper).items():
            if name in _GRAD_BUFFERS:
                census.walk("grads", value)
        for name in _MASTER:
            census.walk("master_params", getattr(wrapper, name, None))
        for group in basic.param_groups:
            for p in group["params"]:
                census.add("master_params", p)
                if pre_step:
                    census.add("fp32_step_grads", p.grad)
        for state in basic.state.values():
            census.walk("optimizer", state)
        for item, nbytes in census.bytes.items():
            self.peak[item] = max(self.peak.get(item, 0), nbytes)

    # -- activations ----------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        ptr, nbytes = _storage(t)
        if ptr in self._params or not ptr:
            return t
        entry = self._live.setdefault(ptr, [nbytes, 0, self._in_head])
        if entry[1] == 0:
            self._live_bytes += nbytes
            self.activation_peak = max(self.activation_peak, self._live_bytes)
            if entry[2]:
                self._logits_bytes += nbytes
                self.logits_peak = max(self.logits_peak, self._logits_bytes)
        entry[1] += 1
        holder = _Saved(t.detach())  # not ``t``: a saved output's holder would keep its own node alive (a cycle)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self._live_bytes -= entry[0]
            self._logits_bytes -= entry[0] if entry[2] else 0
            del self._live[ptr]

    @contextlib.contextmanager
    def step(self):
        """Count activations saved for backward during a micro-batch (a context manager)."""
        if not self.counting:  # the census after every gradient costs ~5x the step on a GPU, for nothing
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    # -- report ---------------------------------------------------------------------------------
    def predicted(self):
        """The planner's estimate for this run's layout, to set beside the measurement."""
        from megakit.core.partition import partition_layers
        from megakit.core.planner.memory import Buckets, estimate_memory
        from megakit.core.planner.model_spec import ModelSpec

        run, plan = self.run, self.run.batch
        zero = run.ds_config.get("zero_optimization", {})
        # the analytic count: the memory model reads per-stage counts, never the total that transformers would
        # give by building the model (5-10 s a rank)
        spec = ModelSpec.from_config(run.cfg.model)
        mtp = run.model.mtp_depth(run.cfg.mtp)
        split = [
            len(r)
            for r in partition_layers(run.model, self.topo.pp, run.cfg.vpp, run.cfg.stage_layers or "params", mtp=mtp)
        ]
        spec = self.spec = spec.with_overrides(seq_len=plan.seq_len, stage_layers=split, mtp=run.cfg.mtp)  # as built
        buckets = Buckets(
            reduce_bucket=int(zero.get("reduce_bucket_size", 5e8)),
            allgather_bucket=int(zero.get("allgather_bucket_size", 5e8)),
        )
        return estimate_memory(
            spec,
            tp=self.topo.tp,
            pp=self.topo.pp,
            dp=self.topo.dp,
            cp=self.topo.cp,
            ep=getattr(self.topo, "ep", 1),
            zero_stage=run.zero_stage,
            micro_batch=plan.micro_batch,
            seq_len=plan.seq_len,
            accumulation=plan.accumulation,
            precision=run.precision,
            stage=self.topo.pp_rank,
            vpp=run.cfg.vpp,
            flash_attention=fused_attention(spec.config),
            buckets=buckets,
            recompute=run.cfg.recompute,
            sequence_parallel=run.sequence_parallel,
            zero_bubble=self.topo.pp > 1 and run.schedule == "zb-h1",
            loss_chunks=run.loss_chunks,
            cp_ring=run.cfg.cp_mode != "a2a",
        )

    def _chunks(self) -> list:
        module = self.engine.module
        return list(module) if isinstance(module, torch.nn.ModuleList) else [module]

    def _saved_logits(self) -> float:
        from megakit.core.planner.activations import logits_bytes

        plan = self.run.batch
        return logits_bytes(
            self.spec,
            tp=self.topo.tp,
            sequence_parallel=self.run.sequence_parallel,
            precision=self.run.precision,
            seq_len=plan.seq_len // self.topo.cp,
            micro_batch=plan.micro_batch,
            transient=False,
            loss_chunks=self.run.loss_chunks,
        )

    def row(self) -> dict:
        """Measured against predicted, item by item, for the memory table."""
        est = self.predicted()
        if torch.cuda.is_available():
            measured = {"total": float(torch.cuda.max_memory_allocated())}
            predicted = {"total": est.total}
        else:
            measured = {k: float(self.peak[k]) for k in ITEMS}
            measured["model_states"] = sum(measured[k] for k in ITEMS)
            measured["fp32_step_grads"] = float(self.peak["fp32_step_grads"])
            measured["activations"] = float(self.activation_peak)
            predicted = {k: float(est.items[k] + est.items.get(f"expert_{k}", 0.0)) for k in ITEMS}  # routed experts
            predicted["model_states"] = sum(predicted[k] for k in ITEMS)
            predicted["fp32_step_grads"] = float(est.items["fp32_step_grads"])
            # The planner's "logits" item is the saved head input, norm input and fp32 softmax plus the
            # logits shard, which it calls transient (not saved for backward): leave that part out.
            logits_shard = 0.0
            if est.items["logits"]:
                bytes_per = 4 if self.run.precision == "fp32" else 2
                logits_shard = (
                    self.run.batch.seq_len
                    // self.topo.cp
                    * self.run.batch.micro_batch
                    * bytes_per
                    * self.spec.padded_vocab(self.topo.tp)
                    // self.topo.tp
                )
                if self.run.loss_chunks > 1:  # one chunk's logits and fp32 softmax
                    logits_shard = est.items["logits"] - self._saved_logits()
            predicted["activations"] = float(
                est.items["activations"] + est.items["moe_routing"] + est.items["logits"] - logits_shard
            )
            measured["logits"], predicted["logits"] = float(self.logits_peak), float(est.items["logits"] - logits_shard)
        return {
            "rank": self.topo.rank,
            "tp": self.topo.tp_rank,
            "pp": self.topo.pp_rank,
            "dp": self.topo.dp_rank,
            "cp": self.topo.cp_rank,
            "measured": measured,
            "predicted": predicted,
        }

    def report(self) -> list[dict] | None:
        """Every rank's row, gathered on rank 0 (None elsewhere). Collective over the world."""
        rows = comm.all_gather_object(self.row(), comm.WORLD)
        return rows if self.topo.rank == 0 else None


def fused_attention(config) -> bool:
    """Whether SDPA runs a fused kernel here, keeping q, k, v, its output and the log-sum-exp rather than the s x s
    probabilities. torch's CPU flash kernel needs q, k and v of one head width (``check_head_dim_size_cpp`` in
    aten/src/ATen/native/transformers/sdp_utils_cpp.cpp), so MLA, whose values are narrower than its keys, runs the
    math path on CPU; CUDA's memory-efficient kernel takes a narrower v (``check_head_dim_size_mem_efficient`` in
    cuda/sdp_utils.cpp asks only q and k for one width)."""
    return torch.cuda.is_available() or config.mla is None or config.mla.v_head_dim == config.mla.qk_head_dim


class _Saved:
    """Holds a saved tensor; its finalizer tells the probe when autograd lets go of it. It holds a detached alias
    (same storage and version counter): holding a tensor that a node saves as its own output (``logsumexp``'s
    result, the MoE router's z-loss) would tie node -> holder -> tensor -> node in a cycle that autograd never frees,
    leaking the router's logits of every micro-batch while measuring."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unpack(x):
    return x.tensor if isinstance(x, _Saved) else x


def format_table(rows: list[dict]) -> str:
    """Per rank: measured/predicted for each item, and the ratio for the two checked totals."""
    items = list(rows[0]["measured"])
    largest = max(max(r["measured"].values()) for r in rows)
    unit, scale = next(
        (u, f) for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if largest >= 10 * f or f == 1
    )
    short = {
        "master_params": "master",
        "optimizer": "adam",
        "fp32_step_grads": "step-grads",
        "model_states": "states",
        "activations": "activations",
        "total": "total",
    }
    head = (
        ["rank", "pp", "dp", "tp"]
        + [short.get(k, k) for k in items]
        + [f"{short.get(k, k)} ratio" for k in items if k in ("model_states", "activations", "total")]
    )
    table = []
    for r in rows:
        cells = [str(r[k]) for k in ("rank", "pp", "dp", "tp")]
        cells += [f"{r['measured'][k] / scale:.2f}/{r['predicted'][k] / scale:.2f}" for k in items]
        cells += [
            f"{r['measured'][k] / r['predicted'][k]:.3f}" if r["predicted"][k] else "-"
            for k in items
            if k in ("model_states", "activations", "total")
        ]
        table.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    lines = [
        f"--verify-memory: measured/predicted {unit} per rank (planner: megakit.core.planner.memory.estimate_memory)"
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head] + table]
    return "\n".join(lines)
