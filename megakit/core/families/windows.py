"""Attention windows as config.json spells them per family, read and written back (shared by the Llama-like families).

transformers 5 writes ``layer_types`` (``full_attention`` or ``sliding_attention`` per block); older files and some
families give a window and a rule instead (Qwen's ``max_window_layers``, Mistral's every block, gpt-oss's even blocks).
"""

from __future__ import annotations

from megakit.errors import UsageError

LAYER_TYPES = ("full_attention", "sliding_attention")  # of transformers' ALLOWED_ATTN_LAYER_TYPES, what megakit runs


def check_layer_types(types) -> None:
    """UsageError naming the ``layer_types`` entries megakit does not run (``LAYER_TYPES``)."""
    unknown = sorted(set(types or ()) - set(LAYER_TYPES))
    if unknown:
        raise UsageError(
            f"layer_types has {', '.join(map(repr, unknown))}, which megakit does not implement; it runs "
            f"{' and '.join(LAYER_TYPES)} (chunked, linear and other attention types are refused)"
        )


def sliding_window(data: dict, kind: str, source: str) -> tuple[int, int, tuple[str, ...]]:
    """``(window, first block using it, layer_types)`` as transformers reads them: Mistral and Mixtral slide every
    block (Mistral 4096 unless null), the Qwens only with ``use_sliding_window`` (Qwen2/3 from ``max_window_layers``
    on, Qwen2-MoE its even blocks below it, Qwen3-MoE all; or as ``layer_types`` says: transformers 5.24's
    rules); gpt-oss its even blocks. A run of last blocks is kept as its first block (``layer_types`` empty, as
    Qwen writes it), any other pattern as ``layer_types``.
    ``(0, 0, ())``: none."""
    n = data.get("num_hidden_layers", 0)
    if kind == "gpt_oss":  # transformers' default: its even blocks slide
        types = data.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        check_layer_types(types)
        window = data.get("sliding_window", 128)
        return (window, 0, tuple(types)) if window else (0, 0, ())
    if kind in ("mistral", "mixtral"):
        window, sliding = data.get("sliding_window", 4096 if kind == "mistral" else None), [True] * n
    elif kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and data.get("use_sliding_window", False):
        window, last, types = (
            data.get(k, d) for k, d in (("sliding_window", 4096), ("max_window_layers", 28), ("layer_types", None))
        )
        check_layer_types(types)
        sliding = (
            [t == "sliding_attention" for t in types]
            if types and kind != "qwen3_moe"
            else [True] * n
            if kind == "qwen3_moe"
            else [i % 2 == 0 and i < last for i in range(n)]
            if kind == "qwen2_moe"
            else [i >= last for i in range(n)]
        )
    else:
        return 0, 0, ()
    if window is None or not any(sliding):
        return 0, 0, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UsageError(f"model config {source} has sliding_window {window!r}; give a positive integer or null")
    start = sliding.index(True)
    if sliding != [i >= start for i in range(len(sliding))]:
        return window, 0, tuple("sliding_attention" if x else "full_attention" for x in sliding)
    return window, start, ()


def window_to_hf(kind: str, window: int, start: int, types: tuple[str, ...] = ()) -> dict:
    """The config.json fields that give transformers' ``kind`` this window (``sliding_window``'s inverse)."""
    if kind in ("qwen2", "qwen3", "qwen2_moe") and types:
        return {
            "use_sliding_window": True,
            "sliding_window": window,
            "max_window_layers": 0,
            "layer_types": list(types),
        }
    if kind == "gpt_oss":
        return {"sliding_window": window or None, "layer_types": list(types)}
    if types:
        raise UsageError(f"a per-block layer_types schedule cannot be written as a transformers {kind} config")
    if kind in ("qwen2", "qwen3"):
        return {"use_sliding_window": bool(window), "sliding_window": window or None, "max_window_layers": start}
    if window and (start or kind not in ("mistral", "mixtral", "qwen3_moe")):
        raise UsageError(f"a sliding window from block {start} cannot be written as a transformers {kind} config")
    if kind == "qwen3_moe":
        return {"use_sliding_window": bool(window), "sliding_window": window or None}
    return {"sliding_window": window or None} if kind in ("mistral", "mixtral") else {}


def number(x: float) -> int | float:
    """``x`` as an int where it is whole (transformers' config classes type some of these fields int)."""
    return int(x) if float(x).is_integer() else x
