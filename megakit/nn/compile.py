"""Regional compilation: ``torch.compile`` of each transformer block, not of the whole model.

Why per block (torchtitan, and PyTorch's "regional compilation" recipe): every block runs the
same code, so Dynamo traces one and reuses the graph for all L of them (its parameters are
graph inputs, not constants), and compile time stays that of one block whatever the depth.
Around the blocks, the things a graph cannot hold stay eager: the pipeline's sends, DeepSpeed's
gradient hooks (they fire on the parameters, outside any graph) and the loss.

What runs inside a compiled block:

- TP/SP's ``f``/``g`` (``megakit.nn.tensor_parallel.layers``) are autograd functions over
  ``megakit.nn.comm``; they stay eager (``torch.compiler.disable`` on the collective), so a
  TP > 1 block is a few graphs joined at its collectives: Inductor still fuses the
  elementwise work between them, and the collectives are the same calls, metered as before.
- Layout-free dropout draws its masks from per-sample generators (``megakit.nn.dropout``),
  which no graph can hold; the draw stays eager, its result enters the graph as a tensor.
- Recompute (``torch.utils.checkpoint`` around the block, or around the attention core)
  wraps the compiled block, and the recompute re-enters the same compiled code.

- An MoE block (``megakit.nn.moe.layer``) at EP 1 is one graph too: the sort by expert has static shapes,
  the counts stay on the device and the experts are grouped GEMMs over device offsets. Under EP
  the all-to-alls stay eager (they need their split sizes on the host): dispatch and combine each
  break the graph once, and Dynamo's nested graph breaks (turned on here for such models) resume
  inside the MoE layer rather than splitting every frame around it: three graphs per block.

With dropout 0 and TP = 1 a block is exactly one graph, an MoE block too (``tests/nn/test_compile.py`` counts them).
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn

from megakit.nn.moe.layer import moe_layers

# Inductor needs a C compiler on CPU; the tests use this backend there so that the plumbing is checked cheaply.
CPU_TEST_BACKEND = "aot_eager"


def compile_blocks(model: nn.Module, *, backend: str = "inductor", mode: str | None = None) -> int:
    """Compile every transformer block of ``model`` (a ``Transformer`` stage) in place; returns how many.

    ``nn.Module.compile`` keeps the module and its parameter names, so checkpoints, DeepSpeed's
    parameter groups and ``full_state_dict`` see the same model as without compile."""
    blocks = list(model.layers.values())
    if any(m.ep > 1 for m in moe_layers(model)):
        # one break on each side of the all-to-alls, not one per frame; process-wide, as Dynamo reads it when it first
        # traces a block (at the first step), and a training process compiles nothing else
        torch._dynamo.config.nested_graph_breaks = True
    for block in blocks:
        block.compile(backend=backend, mode=mode, dynamic=False)
    return len(blocks)


def default_compile(device_type: str, *, cp: int = 1, zero_stage: int = 0) -> bool:
    """On by default on CUDA (Inductor's fused kernels pay there), MoE blocks included, off on CPU, where compile
    time would dwarf the short runs a CPU is used for and the gain is small. Off by default for ring attention
    (CP > 1), whose compiled form is not tested here (``--compile`` still asks for it), and under ZeRO 3, whose
    gathering hooks a compiled block cannot hold (``--compile`` is refused there)."""
    return device_type == "cuda" and cp == 1 and zero_stage != 3
