"""Column-parallel linears that share one input, as one autograd function that overlaps its backward.

Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` (Korthikanti et al. 2022,
arXiv:2205.05198, section 4.2.2). Composed from ``enter_tp_region`` and ``F.linear``, autograd
keeps the all-gathered input ``(S, B, H)`` of every column-parallel projection under sequence
parallelism (``sbh`` per site instead of ``sbh/t``) and runs the backward's reduce-scatter
(without SP: all-reduce) after all the GEMMs. Here, for the projections that read the same
input (q, k, v; gate, up):

- forward: all-gather the sequence (SP; without SP the input is already whole), the GEMMs;
  only this rank's shard ``(S/t, B, H)`` is saved;
- backward: start the all-gather of the saved shard, compute ``grad_input`` meanwhile, start
  its reduce-scatter (without SP: all-reduce), compute the weight gradients on the gathered
  input while it runs, then wait.

Zero bubble (``megakit.nn.pipeline.split_backward``) runs the backward in two passes: B wants only the
input gradient and W only the weights'. The engine says which edges the running pass needs
(``torch._C._will_engine_execute_node``), so B skips the re-gather and the weight GEMMs and W
skips ``grad_input`` and its reduce-scatter: nothing is computed or sent twice. The engine
cannot be asked about a leaf (a weight, AccumulateGrad) inside ``autograd.grad``, so each
tensor enters through ``view_as`` (no copy): the question is then asked of that view's node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakit.nn import comm as C
from megakit.nn.tensor_parallel.collectives import enter_tp_region


def _needed(ctx, index: int) -> bool:
    """Whether the backward pass now running wants the gradient of forward input ``index``."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[ctx.edges[index]][0]  # edges: one per tensor input, in order
    return node is not None and torch._C._will_engine_execute_node(node)


class _ColumnParallelLinears(torch.autograd.Function):
    """forward: (SP) all-gather dim 0, then ``x W_i^T + b_i`` for each i; saves the shard.
    backward: re-gather (async) || ``grad_x``; reduce-scatter or all-reduce of ``grad_x`` (async) || ``grad_W``."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, n, *params):
        weights, biases = params[:n], params[n:]
        full = C.all_gather(x, group, dim=0) if sequence_parallel else x  # (S, B, in)
        ctx.group, ctx.sequence_parallel, ctx.n = group, sequence_parallel, n
        ctx.has_bias = [b is not None for b in biases]
        tensors = [0, *range(4, 4 + n), *(4 + n + i for i, b in enumerate(biases) if b is not None)]
        ctx.edges = {arg: edge for edge, arg in enumerate(tensors)}
        ctx.save_for_backward(x, *weights)  # the shard under SP: the gathered input is freed
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        n, group, sp = ctx.n, ctx.group, ctx.sequence_parallel
        want_x = _needed(ctx, 0)
        want_w = [_needed(ctx, 4 + i) for i in range(n)]
        want_b = [ctx.has_bias[i] and _needed(ctx, 4 + n + i) for i in range(n)]
        gather = any(want_w)
        full, gathered = C.all_gather_async(x, group) if sp and gather else (x, C.Handle(None))
        grad_x, pending = None, C.Handle(None)
        if want_x:
            grad_x = sum(g @ w for g, w in zip(grads, weights))  # (S, B, in), partial over TP
            if sp:
                grad_x, pending = C.reduce_scatter_async(grad_x, group)
            else:
                pending = C.all_reduce_async(grad_x, group)
        gathered.wait()
        flat = full.reshape(-1, full.shape[-1]) if gather else None  # (S*B, in)
        grad_w, grad_b = [], []
        for i, g in enumerate(grads):
            g2 = g.reshape(-1, g.shape[-1])  # (S*B, out/tp)
            grad_w.append(g2.t() @ flat if want_w[i] else None)
            grad_b.append(g2.sum(0) if want_b[i] else None)
        pending.wait()
        return (grad_x, None, None, None, *grad_w, *grad_b)


def column_parallel(x: torch.Tensor, layers, group, sequence_parallel: bool) -> tuple[torch.Tensor, ...]:
    """Apply the ``ColumnParallelLinear`` s ``layers`` (built with ``enter_region=False``) to one input.

    Input ``(S', B, in)`` (the sequence shard under SP); one output ``(S, B, out_i/tp)`` per layer.
    Equal to ``enter_tp_region`` followed by each layer, with the memory and overlap described above.
    """
    if C.size(group) == 1:
        return tuple(layer(x) for layer in layers)
    if (
        torch.compiler.is_compiling()
        or any(layer.matmul is not F.linear for layer in layers)
        or any(layer.lora_scaling is not None for layer in layers)
    ):
        # torch.compile traces the composed functions (the engine questions and async waits below do not trace);
        # a float8 matmul (--fp8) is the layer's own, and so is a LoRA adapter (tensor_parallel.lora): all keep
        # the gathered input, as before
        x = enter_tp_region(x, group, sequence_parallel)
        return tuple(layer(x) for layer in layers)
    weights = [_askable(layer.weight) for layer in layers]
    biases = [_askable(layer.bias) for layer in layers]
    return _ColumnParallelLinears.apply(_askable(x), group, sequence_parallel, len(layers), *weights, *biases)


def _askable(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` behind a node the engine can be asked about (see the module's docstring); no copy."""
    return t.view_as(t) if t is not None and t.requires_grad and t.grad_fn is None else t
