"""The matmul-only bound of a run: its linear layers alone, on the shapes it ran.

The benches record every forward pass a measured run makes (how many token
positions went through the decoder, how many through the output head), then
replay exactly those matrix products with the model's own weights, in the same
order (so the weights stream through the caches as they did), and nothing else:
no attention, norms, sampling, sandbox or Python. Its time is what the run
cannot beat on this machine at this precision; `measured / bound` says how
close a run comes (1.0 = nothing but matrix products).

A training step replays the backward products too: the gradient with respect to
each linear layer's input (the same shape as the forward product), and with
respect to its weight where the weight trains.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F


def _base(model):
    """The plain transformers model under a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _linears(model) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each decoder linear layer's weight in forward order, the output head's weight)."""
    base = _base(model)
    weights = []
    for layer in base.get_decoder().layers:
        for m in layer.modules():
            w = getattr(m, "base_layer", m)
            if isinstance(w, torch.nn.Linear):
                weights.append(w.weight)
    return _dedup(weights), base.get_output_embeddings().weight


def _dedup(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for w in ws:
        if id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


@contextlib.contextmanager
def record_forwards(model):
    """Inside the block, every forward pass of `model` appends [positions through the
    decoder, positions through the output head, whether autograd records it] to the
    yielded list."""
    base = _base(model)
    shapes: list[list] = []

    def on_embed(module, args, out):
        shapes.append([out.shape[0] * out.shape[1], 0, torch.is_grad_enabled()])

    def on_head(module, args, out):
        x = args[0]
        if shapes:
            shapes[-1][1] += x.numel() // x.shape[-1]

    hooks = [base.get_input_embeddings().register_forward_hook(on_embed),
             base.get_output_embeddings().register_forward_hook(on_head)]
    try:
        yield shapes
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def replay_seconds(model, shapes: list[list], backward: str = "none", dtype: torch.dtype | None = None) -> float:
    """Seconds the linear products of `shapes` take: forward, plus for the passes autograd
    recorded the input gradients (`backward="input"`: frozen weights, as under LoRA) or
    the input and weight gradients (`"full"`). Inputs are random: a product's time does
    not depend on its values."""
    weights, head = _linears(model)
    dtype = dtype or weights[0].dtype
    weights, head = [w.to(dtype) for w in weights], head.to(dtype)
    widths = {w.shape[1] for w in weights} | {head.shape[1]}
    t0 = time.perf_counter()
    for n, n_head, *train in shapes:
        back = backward if (train[0] if train else True) else "none"
        xs = {k: torch.randn(n, k, dtype=dtype) for k in widths}  # one contiguous input per width
        for w in weights:
            x = xs[w.shape[1]]
            y = F.linear(x, w)
            if back != "none":
                torch.mm(y, w)  # dL/dx: the same shape of product
                if back == "full":
                    torch.mm(y.t(), x)  # dL/dW
        if n_head:
            x = xs[head.shape[1]][:n_head]
            logits = F.linear(x, head)
            if back != "none":
                torch.mm(logits, head)
                if back == "full":
                    torch.mm(logits.t(), x)
    return time.perf_counter() - t0
