"""A decoder-only transformer (GPT-2 and Llama families) built from megakit's TP layers.

One class serves every layout: ``Transformer(config, topo)`` holds the calling rank's
TP shard, and ``layers=range(a, b)``, ``pre``, ``post`` cut out a pipeline stage.

Activations inside the model are sequence-first: ``(S, B, H)``, or ``(S/tp, B, H)``
with sequence parallelism; with context parallelism ``S`` is the rank's ``S/cp`` tokens (two
chunks of the load-balanced split, ``megakit.nn.attention.ring``). A stage without ``pre`` takes, and a stage without
``post`` returns, exactly that tensor, so one stage's output feeds the next as is.

Weights depend only on ``(seed, parameter name)``: see ``megakit.nn.weights``.
Parameter names do not depend on the layout (blocks are keyed by their global
index), so a pipeline stage's names are a subset of the full model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megakit.core.model_config import ModelConfig, check_seq_len, model_flops_per_token  # noqa: F401 (API)
from megakit.core.partition import partition_layers
from megakit.errors import UsageError
from megakit.nn import comm as C
from megakit.nn.attention.core import apply_rope, rms_norm, rope_tables  # noqa: F401 (API)
from megakit.nn.block import Block, Norm, ResidualDropout
from megakit.nn.dropout import DropoutKeys
from megakit.nn.moe.layer import counting
from megakit.nn.mtp import PredictionModule, depth_labels, shifted
from megakit.nn.sequence import positions, sequence_mean
from megakit.nn.tensor_parallel.chunked_loss import chunked_head_loss
from megakit.nn.tensor_parallel.collectives import enter_tp_region, replicated
from megakit.nn.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, mark
from megakit.nn.tensor_parallel.preference import preference_loss
from megakit.nn.weights import init_shard_

__all__ = [
    "ModelConfig",
    "Transformer",
    "build_stage_chunks",
    "full_state_dict",
    "load_full_state_dict",
    "model_flops_per_token",
]

# Mamba-2's reference start: A = -1 .. -heads, D one, dt = softplus(dt_bias) = 0.01 (mamba_ssm's dt in [1e-3, 0.1])
MAMBA_INIT = {"A_log": ("log_index",), "D": ("ones",), "dt_bias": ("fill", -4.600166)}


class Transformer(nn.Module):
    """The model, or one pipeline stage of it, holding this rank's TP shard.

    ``forward(x, labels=None)``: with ``pre``, ``x`` is token ids ``(B, S)``; otherwise the
    previous stage's hidden state ``(S', B, H)`` (``S' = S/tp`` with sequence parallelism).
    With ``post`` and ``labels`` ``(B, S)``: the scalar mean token cross-entropy (vocab-
    parallel; ``-100`` labels ignored). With ``post`` alone: this rank's logits shard
    ``(B, S, padded_vocab/tp)``, padded columns set to ``-inf``. Otherwise the hidden state.
    ``sample_ids`` ``(B,)``: each row's number in the run's data stream, which with ``seed``
    decides the dropout masks (``megakit.nn.dropout``), so they are the same at every
    layout; a trainer passes them. Without them a training forward numbers its rows after
    those of the previous training forwards (``samples_seen``).
    ``recompute``: ``"full"`` (``True``) keeps each block's input only and recomputes the rest in backward
    (~1/3 more compute); ``"selective"`` recomputes the attention core (Korthikanti et al. 2022); ``"none"``.
    Context parallelism (``topo.cp > 1``): ids and labels are still the whole ``(B, S)``; the rank keeps
    the ``S/cp`` positions ``megakit.nn.attention.ring.positions`` names (hidden states and logits
    hold those rows, in that order) and the loss is the mean over the whole sequence, the same on
    every CP rank, whose gradient on each rank is CP times its share (DP x CP averages it back).
    ``loss_chunks`` K > 1: with labels, the head and loss run over K chunks of the tokens
    (``megakit.nn.tensor_parallel.chunked_loss``), so the logits shard never exists whole; the same loss and gradients.
    ``loss_tokens`` (``set_loss_tokens``): divide the summed loss by the trainer's token count instead of the
    batch's own, so that a step whose micro-batches count different tokens trains sum(loss) / sum(tokens).
    ``mtp``: the last stage holds the config's ``mtp_layers`` Multi-Token Prediction modules (``megakit.nn.mtp``);
    a training forward with labels returns ``L_main + mtp_weight / D x sum(L_k)`` (the ``L_k`` in
    ``mtp_losses``), an evaluating one ``L_main``. They read the ids: on a stage without ``pre``, pass
    them as ``input_ids``.
    """

    def __init__(
        self,
        config: ModelConfig,
        topo=None,
        *,
        layers: range | None = None,
        pre: bool = True,
        post: bool = True,
        sequence_parallel: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device=None,
        recompute: bool | str = False,
        loss_chunks: int = 1,
        mtp: bool = False,
        mtp_weight: float = 0.1,
    ) -> None:
        super().__init__()
        group = None if topo is None else topo.tp_group
        tp, tp_rank = C.size(group), C.rank(group)
        self.cp_group = topo.cp_group if getattr(topo, "cp", 1) > 1 else None
        self.cp, self.cp_rank = C.size(self.cp_group), C.rank(self.cp_group)
        self.ep_group = topo.ep_group if getattr(topo, "ep", 1) > 1 else None  # experts split over EP ranks
        self.ep_rank = C.rank(self.ep_group)
        if self.ep_group is not None and config.moe is None:
            raise UsageError(
                f"--ep {topo.ep} asks for expert parallelism but the model has no experts; "
                "drop --ep or use an MoE model config"
            )
        config.check_tp(tp)
        layers = range(config.layers) if layers is None else layers
        if not isinstance(layers, range) or layers.step != 1 or not (0 <= layers.start <= layers.stop <= config.layers):
            raise UsageError(f"layers must be a range within 0..{config.layers}, got {layers!r}")
        self.config, self.group, self.tp, self.tp_rank = config, group, tp, tp_rank
        self.layer_range, self.pre, self.post, self.seed = layers, pre, post, seed
        recompute = {False: "none", True: "full"}.get(recompute, recompute)
        if recompute not in ("none", "selective", "full"):
            raise UsageError(f"recompute {recompute!r} is not one of none, selective, full")
        self.recompute, self.sequence_parallel = recompute == "full", sequence_parallel and tp > 1  # full: per block
        self.samples_seen = 0  # rows numbered by training forwards without sample_ids
        if loss_chunks < 1:
            raise UsageError(f"loss_chunks must be at least 1 (1: the head and loss in one piece), got {loss_chunks}")
        self.loss_chunks = loss_chunks
        # The summed loss's divisor (``set_loss_tokens``): the step's valid tokens over the micro-batches that
        # DeepSpeed averages, so that its averages give sum(loss)/sum(tokens) over the step. None: this
        # micro-batch's own mean.
        self.loss_tokens: float | torch.Tensor | None = None  # with MTP: (1 + D,), the main loss's then each depth's
        self.mtp_weight, self.mtp_losses = mtp_weight, []
        # A pair objective (``set_preference``) in place of the token loss, and its statistics' sums since read
        self.preference, self.preference_stats = None, None
        mtp_depth = trained_mtp_depth(config, mtp, mtp_weight)  # checked on every stage alike; built on the last
        kw = dict(group=group, sequence_parallel=self.sequence_parallel, dtype=dtype, device=device)
        tied = config.tie_embeddings
        if pre or (post and (tied or mtp_depth > 0)):  # a tied or MTP last stage keeps a copy, under the same name
            self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden, **kw)
            # DeepSpeed counts a ds_pipe_replicated parameter once (on the first stage) in the grad norm.
            self.embed.weight.ds_pipe_replicated = not pre
        if pre and config.family == "gpt2":
            table = torch.empty(config.max_seq_len, config.hidden, dtype=dtype, device=device)
            self.pos_embed = nn.Embedding(config.max_seq_len, config.hidden, _weight=table)  # no default init
            mark(self.pos_embed.weight, None)
        if pre:
            self.embed_dropout = ResidualDropout(config.dropout, "embed", group, self.sequence_parallel, self.cp_group)
        # selective: the attention core, in Attention
        blocks = dict(selective=recompute == "selective", cp_group=self.cp_group, ep_group=self.ep_group, **kw)
        self.layers = nn.ModuleDict({str(i): Block(config, index=i, **blocks) for i in layers})
        if post:
            self.norm = Norm(config, **kw)
            if not tied:
                self.lm_head = ColumnParallelLinear(config.hidden, config.padded_vocab(tp), bias=False, **kw)
                self.lm_head.weight.tp_unpadded = config.vocab_size
            self.mtp = nn.ModuleList(PredictionModule(config, depth=k, **blocks) for k in range(1, mtp_depth + 1))
        if config.family == "llama":
            cos, sin = rope_tables(config, device)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
            local = next((i for i in layers if self.layers[str(i)].local_rope), None)
            if local is not None:  # Gemma 3: its sliding blocks' own RoPE
                cos, sin = rope_tables(config, device, local)
                self.register_buffer("local_rope_cos", cos, persistent=False)
                self.register_buffer("local_rope_sin", sin, persistent=False)
        self.reset_parameters()

    # -- initialisation ----------------------------------------------------------------------
    def init_rule(self, name: str) -> tuple:
        """How the parameter called ``name`` starts: GPT-2's scheme, for both families.

        Norm weights one, biases zero, output projections (``o_proj``, ``down_proj``, the experts'
        stacked ``experts.down_proj``) ``N(0, (std / sqrt(2 L))^2)``, everything else ``N(0, std^2)``.
        """
        leaf = name.rsplit(".", 2)
        if leaf[-1] in MAMBA_INIT and ".mixer." in name:  # Mamba-2's per-head A_log, D and dt_bias
            return MAMBA_INIT[leaf[-1]]
        if leaf[-1] == "bias":
            return ("zeros",)
        if leaf[-2] == "gated_norm":  # Gated DeltaNet's output norm: times its weight (not 1 + weight) in Qwen3-Next
            return ("ones",)
        if "norm" in leaf[-2]:
            return ("zeros",) if self.config.norm_offset else ("ones",)  # Gemma's norms: times 1 + weight
        std = self.config.init_std
        if leaf[-2] in ("o_proj", "down_proj", "out_proj") or leaf[-2:] == ["experts", "down_proj"]:
            std /= (2 * self.config.layers) ** 0.5
        return ("normal", std)

    def reset_parameters(self) -> None:
        """(Re)draw every parameter of this shard from ``(seed, name)``; see ``megakit.nn.weights``."""
        for name, param in self.named_parameters():
            init_shard_(
                param, name=name, seed=self.seed, tp_rank=self.tp_rank, rule=self.init_rule(name), ep_rank=self.ep_rank
            )

    # -- forward -----------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        sample_ids: torch.Tensor | list[int] | None = None,
        documents: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``documents`` ``(B, S)``: attention stays inside each packed document; ``position_ids`` ``(B, S)``: each
        token's position (``attention.masks``; default 0..S-1). Both are the whole sequence's, on every stage,
        and so are ``input_ids``, which only a last stage training MTP modules reads. ``reference`` ``(B, K)``: with a
        pair objective, the starting model's log-probability of each row's K sequences (its documents)."""
        keys = self._dropout_keys(x, sample_ids)
        seq_len = x.shape[1] if self.pre else x.shape[0] * (self.tp if self.sequence_parallel else 1) * self.cp
        held = None if self.cp == 1 else self._held_positions(seq_len, x.device)  # (S/cp,) global positions
        if position_ids is not None and held is not None:
            position_ids = position_ids.index_select(1, held)  # (B, S/cp): this rank's rows
        h = self._embed(x, keys, held, position_ids) if self.pre else x  # (S', B, H)
        ropes = {False: self._rope("rope", position_ids, held), True: self._rope("local_rope", position_ids, held)}
        for block in self.layers.values():
            rope = ropes[block.local_rope]
            if self.recompute and self.training:  # keep only the block's input; masks are redrawn alike
                h = torch.utils.checkpoint.checkpoint(counting(block), h, rope, keys, documents, use_reentrant=False)
            else:
                h = block(h, rope, keys, documents)  # (S', B, H)
        if not self.post:
            return h
        h = self.norm(h)  # (S', B, H)
        if labels is None:
            return self._logits(h)
        if self.preference is not None:
            return self._preference_loss(h, labels, held, documents, reference)
        loss = self._head_loss(h, labels, held, depth=0)
        if len(self.mtp) and self.training:
            ids = x if self.pre else input_ids
            if ids is None:
                raise UsageError("the MTP modules read the token ids on the last stage; pass input_ids=")
            loss = loss + self._mtp_loss(h, ids, labels, held, ropes, keys, documents)
        return loss

    def _mtp_loss(self, g, ids, labels, held, ropes, keys, documents) -> torch.Tensor:
        """``lambda / D x sum_k L_k`` over the prediction modules, ``g`` the main model's normed output."""
        losses = []
        for k, module in enumerate(self.mtp, start=1):
            embedded = self._token_embeddings(shifted(ids, k, 0), held)  # Emb(t_{i+k}) at this rank's rows
            rope = ropes[module.block.local_rope]
            if self.recompute:
                g = torch.utils.checkpoint.checkpoint(
                    counting(module), g, embedded, rope, keys, documents, use_reentrant=False
                )
            else:
                g = module(g, embedded, rope, keys, documents)
            losses.append(self._head_loss(g, depth_labels(labels, k, documents), held, depth=k))
        self.mtp_losses = [loss.detach() for loss in losses]
        return self.mtp_weight / len(losses) * torch.stack(losses).sum()

    def _head_loss(self, h: torch.Tensor, labels: torch.Tensor, held, *, depth: int) -> torch.Tensor:
        """The mean cross-entropy of ``labels`` (the whole ``(B, S)``) under the head on ``h`` ``(S', B, H)``:
        divided by the trainer's count of depth ``depth``'s tokens, else by this batch's own (over CP)."""
        head = self._head_weight()  # (V/tp, H)
        h = enter_tp_region(h, self.group, self.sequence_parallel)  # (S, B, H)
        target = labels.t() if held is None else labels.index_select(1, held).t()  # (S, B), (S/cp, B) with CP
        tokens = self._loss_tokens(depth)
        if self.loss_chunks > 1:
            total = chunked_head_loss(
                h, head, target, self.group, chunks=self.loss_chunks, vocab_size=self.config.vocab_size
            )
        else:
            total = vocab_parallel_cross_entropy(
                F.linear(h, head), target, self.group, vocab_size=self.config.vocab_size, reduction="sum"
            )
        if held is not None:
            return sequence_mean(total, target != -100, self.cp_group, tokens)
        return total / (tokens if tokens is not None else (target != -100).sum().clamp(min=1))

    def _preference_loss(self, h, labels, held, documents, reference) -> torch.Tensor:
        """The pair objective over this batch's sequences (``megakit.nn.tensor_parallel.preference``), divided by
        the trainer's share of the step's pairs (``loss_tokens``); its statistics' sums add to ``preference_stats``."""
        if documents is None:
            raise UsageError("a pair objective needs each sequence as its own document; pass --reset-attention-mask")
        head = self._head_weight()  # (V/tp, H)
        h = enter_tp_region(h, self.group, self.sequence_parallel)  # (S, B, H)
        target = labels.t() if held is None else labels.index_select(1, held).t()  # (S, B), (S/cp, B) with CP
        docs = documents.t() if held is None else documents.index_select(1, held).t()
        token_losses = vocab_parallel_cross_entropy(
            F.linear(h, head), target, self.group, vocab_size=self.config.vocab_size, reduction="none"
        )
        loss, stats, logps = preference_loss(
            self.preference,
            token_losses,
            target,
            docs,
            reference=reference,
            pairs=self.loss_tokens,
            cp_group=self.cp_group,
        )
        self.preference_stats = stats if self.preference_stats is None else self.preference_stats + stats
        self.sequence_logps = logps.detach()  # the reference pass reads them
        return loss.to(h.dtype)

    def _loss_tokens(self, depth: int):
        """The trainer's token count for depth ``depth`` (0: the main loss): one of its ``(1 + D,)`` counts, its one
        count (a model without MTP modules), or None: the batch's own."""
        tokens = self.loss_tokens
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 1:
            return tokens[depth]
        if depth and tokens is not None:
            raise UsageError(
                "set_loss_tokens was given one count but the model trains MTP modules; give "
                "(1 + D,) counts (megakit.nn.mtp.depth_token_counts)"
            )
        return tokens

    def _head_weight(self) -> torch.Tensor:
        """The LM head's shard ``(V/tp, H)``: its own, or the tied embedding's."""
        return self.lm_head.weight if hasattr(self, "lm_head") else self.embed.weight

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's logits shard ``(B, S, V/tp)``, padded columns ``-inf``."""
        logits = F.linear(enter_tp_region(h, self.group, self.sequence_parallel), self._head_weight()).transpose(0, 1)
        start = self.tp_rank * logits.shape[-1]
        if start + logits.shape[-1] > self.config.vocab_size:
            logits = logits.clone()
            logits[..., max(self.config.vocab_size - start, 0) :] = float("-inf")
        return logits

    def _rope(self, name: str, position_ids, held) -> tuple | None:
        """The ``name`` RoPE tables (cos, sin) at this rank's positions: each row's own (``position_ids``, ``(B, S',
        d)``), its CP rows' global ones (``held``), or 0..S-1; None without such tables (GPT-2, no local RoPE)."""
        if not hasattr(self, f"{name}_cos"):
            return None
        cos, sin = getattr(self, f"{name}_cos"), getattr(self, f"{name}_sin")
        if position_ids is not None:
            return cos[position_ids], sin[position_ids]
        return (cos[held], sin[held]) if held is not None else (cos, sin)

    def _dropout_keys(self, x: torch.Tensor, sample_ids) -> DropoutKeys | None:
        if not self.training or self.config.dropout == 0.0:
            return None
        batch = x.shape[0] if self.pre else x.shape[1]  # ids (B, S); hidden (S', B, H)
        if sample_ids is None:
            sample_ids = range(self.samples_seen, self.samples_seen + batch)
        self.samples_seen += batch
        keys = DropoutKeys.of(self.seed, sample_ids)
        if len(keys.samples) != batch:
            raise UsageError(f"sample_ids has {len(keys.samples)} numbers for a batch of {batch}; give one per row")
        return keys

    def _held_positions(self, seq_len: int, device) -> torch.Tensor:
        if seq_len % (2 * self.cp):
            raise UsageError(
                f"sequence length {seq_len} is not divisible by 2 x CP = {2 * self.cp}; context "
                "parallelism splits it into that many equal chunks (pad the batch or change --cp)"
            )
        return positions(seq_len, self.cp, self.cp_rank, device=device)

    def _embed(
        self,
        ids: torch.Tensor,
        keys: DropoutKeys | None,
        held: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise UsageError(
                f"the first stage takes token ids of shape (batch, seq) and integer dtype, "
                f"got {tuple(ids.shape)} {ids.dtype}"
            )
        check_seq_len(self.config, ids.shape[1])
        h = self._token_embeddings(ids, held)  # (S', B, H)
        s = ids.shape[1] if held is None else held.numel()
        if hasattr(self, "pos_embed"):
            local = s // self.tp if self.sequence_parallel else s
            offset = self.tp_rank * local if self.sequence_parallel else 0
            table = replicated(self.pos_embed.weight, self.group, self.sequence_parallel)
            if position_ids is not None:  # (B, S) held rows: each row's own positions
                h = h + F.embedding(position_ids[:, offset : offset + local], table).transpose(0, 1)  # (S', B, H)
            else:
                where = torch.arange(s, device=ids.device) if held is None else held
                h = h + F.embedding(where[offset : offset + local], table).unsqueeze(1)  # (S', B, H)
        return self.embed_dropout(h, keys)

    def _token_embeddings(self, ids: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
        """The embeddings ``(S', B, H)`` of ``ids`` ``(B, S)`` at this rank's rows (its CP chunks, its SP slice)."""
        if held is not None:
            ids = ids.index_select(1, held)  # (B, S/cp): this CP rank's two chunks
        if self.sequence_parallel and ids.shape[1] % self.tp:
            raise UsageError(
                f"sequence length {ids.shape[1]} is not divisible by TP {self.tp}; sequence parallelism "
                "needs it to be (pad the batch or turn sequence parallelism off)"
            )
        h = self.embed(ids.t())  # (S', B, H)
        if self.config.embed_scale != 1.0:  # Gemma: times sqrt(hidden), rounded to the weights' dtype as transformers
            h = h * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(h.dtype)
        return h


def build_stage_chunks(config, topo, *, vpp: int = 1, method="params", **model_kwargs) -> list[Transformer]:
    """This rank's ``Transformer`` chunks for a ``pp x vpp`` split (embedding on the first, head and any MTP modules on
    the last, which the balanced split gives fewer blocks: the planner's split)."""
    ranges = partition_layers(config, topo.pp, vpp, method, mtp=config.mtp_depth(model_kwargs.get("mtp", False)))
    last = topo.pp * vpp - 1
    chunks = []
    for chunk in range(vpp):
        vs = chunk * topo.pp + topo.pp_rank
        chunks.append(Transformer(config, topo, layers=ranges[vs], pre=vs == 0, post=vs == last, **model_kwargs))
    return chunks


# -- whole-model views (tests, checkpoints, resharding) ---------------------------------------
def trained_mtp_depth(config: ModelConfig, mtp: bool, weight: float) -> int:
    """How many MTP modules a last stage builds: the config's when ``mtp`` is asked (``ModelConfig.mtp_depth``, the
    planner's count too), else none."""
    if mtp and not weight > 0:
        raise UsageError(f"the MTP loss weight must be positive (DeepSeek-V3 trained with 0.3, then 0.1), got {weight}")
    depth = config.mtp_depth(mtp)
    if depth and config.family != "llama":
        raise UsageError("MTP needs a RoPE model (llama family); GPT-2's learned positions are not supported")
    return depth


def mtp_depth(module: nn.Module) -> int:
    """The MTP modules a loss-computing ``Transformer`` inside ``module`` trains (0: none)."""
    return max((len(m.mtp) for m in module.modules() if isinstance(m, Transformer) and m.post), default=0)


def set_preference(module: nn.Module, preference) -> None:
    """Every loss-computing ``Transformer`` inside ``module`` trains ``preference`` (a ``Preference``; None: the token
    loss) from now on: its loss divisor (``set_loss_tokens``) is then the trainer's share of the step's pairs."""
    for m in module.modules():
        if isinstance(m, Transformer) and m.post:
            if preference is not None and (len(m.mtp) or m.loss_chunks > 1):
                raise UsageError(
                    "a pair objective does not train MTP modules nor run --loss-chunks; drop --mtp / --loss-chunks"
                )
            m.preference = preference


def set_loss_tokens(module: nn.Module, tokens: float | torch.Tensor | None) -> None:
    """Every loss-computing ``Transformer`` inside ``module`` (a model, an engine, a list of chunks) divides its
    summed loss by ``tokens`` from now on (None: by its batch's own valid tokens)."""
    for m in module.modules():
        if isinstance(m, Transformer) and m.post:
            m.loss_tokens = tokens


def _group(topo):
    return None if topo is None else topo.tp_group


def _ep_group(topo):
    return topo.ep_group if getattr(topo, "ep", 1) > 1 else None


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers saved with the weights (the MoE expert bias); rotary tables are not."""
    keys = set(model.state_dict(keep_vars=True))
    return {name: b for name, b in model.named_buffers() if name in keys}


@torch.no_grad()
def full_state_dict(model: nn.Module, topo=None, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of this stage (or, with ``grads``, its gradient), gathered over TP (and MoE
    experts over EP) and with vocab padding removed; without ``grads`` also the persistent
    buffers (the MoE expert bias).

    Collective over the TP and EP groups: every rank of them must call it. Returns name -> full tensor.
    """
    group, out = _group(topo), {}
    for name, param in model.named_parameters():
        full = param.detach() if not grads else param.grad if param.grad is not None else torch.zeros_like(param)
        if getattr(param, "ep_dim", None) is not None:
            full = C.all_gather(full.contiguous(), _ep_group(topo), dim=param.ep_dim)
        dim = getattr(param, "tp_dim", None)
        if dim is not None:
            full = C.all_gather(full.contiguous(), group, dim=dim)
            unpadded = getattr(param, "tp_unpadded", None)
            if unpadded is not None:
                full = full.narrow(dim, 0, unpadded)
        out[name] = full.clone()
    if not grads:
        out.update({name: b.detach().clone() for name, b in _persistent_buffers(model).items()})
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], topo=None, *, strict: bool = True) -> None:
    """Copy this rank's shard of each full tensor in ``state`` into ``model`` (inverse of above)."""
    group, ep_group = _group(topo), _ep_group(topo)
    tp, rank = C.size(group), C.rank(group)
    params = dict(model.named_parameters())
    for name, buffer in _persistent_buffers(model).items():
        if name in state:
            buffer.copy_(state[name])
    missing = sorted(set(params) - set(state))
    if strict and missing:
        raise UsageError(
            f"state lacks {len(missing)} parameters of the model, e.g. {missing[:3]}; "
            "it was saved from a different model"
        )
    for name, param in params.items():
        if name not in state:
            continue
        full = state[name]
        if getattr(param, "ep_dim", None) is not None:
            local = param.shape[param.ep_dim]
            full = full.narrow(param.ep_dim, C.rank(ep_group) * local, local)
        dim = getattr(param, "tp_dim", None)
        if dim is not None:
            padded = param.shape[dim] * tp
            if full.shape[dim] < padded:
                pad = list(full.shape)
                pad[dim] = padded - full.shape[dim]
                full = torch.cat([full, full.new_zeros(pad)], dim=dim)
            full = full.narrow(dim, rank * param.shape[dim], param.shape[dim])
        if full.shape != param.shape:
            raise UsageError(
                f"parameter {name} has shape {tuple(full.shape)} in the state but the model "
                f"shard needs {tuple(param.shape)}; it was saved from a different model"
            )
        param.copy_(full)
