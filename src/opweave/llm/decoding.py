"""Greedy generation on a compiled decode step: :func:`generate` and :class:`Decoder`.

The token loop stays in Python, as gpt-fast's does; each step is one call of one compiled model
(:class:`~opweave.llm.step.DecodeStep` compiled by :func:`opweave.compile`): on CUDA one CUDA Graph replay per token,
the cache written in place across replays; on the CPU the default's choice. The prefill (the prompt's tokens at
once) and the decode step (one token) are two input signatures of that one compiled model: it is compiled for the
step, and the prompt's length is another signature, built at its first call. A :class:`Decoder` is kept per model,
batch size, cache length and options (:func:`decoder`), so a second generation compiles nothing.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opweave.api import compile as compile_model
from opweave.errors import UsageError
from opweave.llm.step import DecodeStep

CACHE_QUANTUM = 64  # a generation's cache holds its tokens rounded up to a multiple of this many slots


class Decoder:
    """``model`` compiled as a decode step over a static cache of ``batch_size`` rows and ``max_len`` slots
    (:class:`~opweave.llm.step.DecodeStep`, compiled by :func:`opweave.compile` with ``options``)."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, **options: Any):
        self.step = DecodeStep(model, batch_size, max_len).eval()
        device = self.step.device
        self.positions = torch.arange(max_len, device=device)
        example = (torch.zeros(batch_size, 1, dtype=torch.long, device=device), self.positions[:1].clone())
        self.compiled = compile_model(self.step, example, **options)
        self.batch_size, self.max_len = batch_size, max_len
        self.runtime = None
        if self.compiled.device == "cuda":  # the token loop's own ops go where the backend issues its ops
            from opweave.backends.runtime import CUDA

            self.runtime = self.compiled.options.runtime if self.compiled.options else None
            self.runtime = self.runtime or CUDA

    def issue(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, tensor work of the token loop: on CUDA issued on the current stream through the compiled
        model's runtime, after the step's work, as the backend issues its own (the fake CUDA runtime runs it
        there, in order)."""
        if self.runtime is None:
            return fn(*args)
        return self.runtime.launch(self.runtime.current_stream(self.positions.device), fn, *args)

    def __call__(self, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [B, T, V] of ``input_ids`` [B, T] at positions ``start ..`` (their keys and values cached)."""
        tokens = input_ids.shape[1]
        if start + tokens > self.max_len:
            raise UsageError(f"positions {start}..{start + tokens - 1} are past the cache's {self.max_len} slots")
        with torch.no_grad():
            return self.compiled(input_ids, self.positions[start:start + tokens])

    def close(self) -> None:
        self.compiled.close()


_DECODERS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Decoder]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def decoder(model: nn.Module, batch_size: int, max_len: int, **options: Any) -> Decoder:
    """The :class:`Decoder` of ``model`` for these sizes and options, compiled at the first request and kept while
    the model lives."""
    key = (batch_size, max_len, tuple(sorted((k, repr(v)) for k, v in options.items())))
    with _LOCK:
        kept = _DECODERS.setdefault(model, {})
        if key not in kept:
            kept[key] = Decoder(model, batch_size, max_len, **options)
        return kept[key]


def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *, return_logits: bool = False,
             **options: Any) -> Any:
    """``model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)`` on a compiled decode step:
    the prompt ``input_ids`` [B, T] followed by up to ``max_new_tokens`` greedy tokens per row.

    As transformers' greedy search: a row that has produced the end-of-sequence token (the model's generation
    configuration's ``eos_token_id``, one or several) continues with ``pad_token_id`` (the end-of-sequence token
    where none is set), and the loop stops once every row has ended. Rows are prompts of one length (no padding);
    no logits processor is applied. ``options`` go to :func:`opweave.compile` (``device``, ``scheduler``,
    ``runtime``, ...). ``return_logits``: also each step's logits of the last position, [B, V] per generated token.

    >>> import torch, opweave
    >>> from opweave.llm import models
    >>> model = models.create("llama", tiny=True)
    >>> prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    >>> tokens = opweave.generate(model, prompt, max_new_tokens=4, device="cpu", scheduler="sequential")
    >>> torch.equal(tokens, model.generate(prompt, max_new_tokens=4, do_sample=False))
    True
    """
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise UsageError(f"input_ids must be token ids of shape [batch, tokens], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rows, prompt = input_ids.shape
    max_len = CACHE_QUANTUM * math.ceil((prompt + max_new_tokens) / CACHE_QUANTUM)
    run = decoder(model, rows, max_len, **options)
    eos, pad = _end_tokens(model, run.positions.device)
    return greedy(run, input_ids.to(run.positions.device, torch.long), max_new_tokens, eos=eos, pad=pad,
                  issue=run.issue, return_logits=return_logits)


def greedy(run: Callable[[torch.Tensor, int], torch.Tensor], input_ids: torch.Tensor, max_new_tokens: int, *,
           eos: torch.Tensor | None = None, pad: int = 0, issue: Callable[..., Any] | None = None,
           return_logits: bool = False) -> Any:
    """The greedy token loop over ``run(input_ids, start) -> logits`` (the prompt at ``start=0``, then one token a
    step): the prompt and up to ``max_new_tokens`` tokens per row, as :func:`generate` returns them (``eos``: the
    end-of-sequence tokens, a row that has produced one continues with ``pad``; the loop stops once every row has).
    ``issue(fn, *args)`` runs the loop's own tensor work (default: at once; :meth:`Decoder.issue`)."""
    issue = issue or (lambda fn, *args: fn(*args))
    rows, prompt = input_ids.shape
    ended = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    tokens, steps = [], []
    token = None
    for i in range(max_new_tokens):
        logits = run(input_ids, 0) if token is None else run(token[:, None], prompt + i - 1)
        last, token, ended = issue(_pick, logits, ended, eos, pad)
        tokens.append(token)
        if return_logits:
            steps.append(last)
        if eos is not None and issue(_all, ended):
            break
    out = issue(_joined, input_ids, tokens)
    return (out, steps) if return_logits else out


def _pick(logits: torch.Tensor, ended: torch.Tensor, eos: torch.Tensor | None, pad: int):
    """The last position's logits, the greedy token of each row (``pad`` for a row that has ended), and which rows
    have ended once it is taken."""
    last = logits[:, -1]
    token = last.argmax(-1)
    if eos is not None:
        token = torch.where(ended, torch.full_like(token, pad), token)
        ended = ended | torch.isin(token, eos)
    return last, token, ended


def _all(ended: torch.Tensor) -> bool:
    return bool(ended.all())


def _joined(prompt: torch.Tensor, tokens: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([prompt, torch.stack(tokens, 1)], 1)


def _end_tokens(model: nn.Module, device: torch.device) -> tuple[torch.Tensor | None, int]:
    """The end-of-sequence tokens of ``model``'s generation configuration (None: none) and the padding token."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return None, 0
    ids = [eos] if isinstance(eos, int) else list(eos)
    pad = getattr(config, "pad_token_id", None)
    return torch.tensor(ids, device=device), ids[0] if pad is None else pad
