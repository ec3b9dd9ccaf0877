"""What kind of operator an op is: one table, read everywhere (capture sets it on each op of the IR, the fitted
cost model prices ops by it, the category compute or memory follows from it). Pure: no torch, so a graph loaded from
JSON without kinds gets them from its targets by the same rule.

A kind is looked up by the last part of an op's target, lowercased (``torch.nn.Conv2d`` and ``aten.convolution``
are both ``conv``); a target in no row is ``elementwise``."""

from __future__ import annotations

from typing import Any

COMPUTE_KINDS = frozenset({"conv", "linear", "matmul", "einsum", "rnn", "attention"})

KIND_OF: dict[str, str] = {}
for _kind, _names in {
    "conv": "conv1d conv2d conv3d convolution _convolution conv_transpose1d conv_transpose2d conv_transpose3d "
            "convtranspose1d convtranspose2d convtranspose3d",
    "linear": "linear",
    "matmul": "matmul mm bmm addmm baddbmm addbmm addmv mv dot",
    "einsum": "einsum",
    "rnn": "lstm gru rnn lstmcell grucell rnncell",
    "attention": "multiheadattention scaled_dot_product_attention",
    "pool": "maxpool1d maxpool2d maxpool3d avgpool1d avgpool2d avgpool3d max_pool1d max_pool2d max_pool3d "
            "avg_pool1d avg_pool2d avg_pool3d max_pool2d_with_indices max_pool3d_with_indices lppool1d lppool2d "
            "lp_pool1d lp_pool2d",
    "adaptive_pool": "adaptiveavgpool1d adaptiveavgpool2d adaptiveavgpool3d adaptivemaxpool1d adaptivemaxpool2d "
                     "adaptivemaxpool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d "
                     "adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d _adaptive_avg_pool2d",
    "norm": "batchnorm1d batchnorm2d batchnorm3d batch_norm layernorm layer_norm groupnorm group_norm "
            "instancenorm1d instancenorm2d instancenorm3d instance_norm localresponsenorm local_response_norm "
            "rmsnorm rms_norm normalize native_batch_norm native_layer_norm native_group_norm "
            "_native_batch_norm_legit _native_batch_norm_legit_no_training",
    "softmax": "softmax log_softmax _softmax _log_softmax softmin logsoftmax",
    "reduce": "sum mean amax amin prod std var logsumexp cumsum cumprod norm argmax argmin all any",
    "data": "cat concat concatenate stack hstack vstack pad constant_pad_nd clone copy embedding embedding_bag "
            "gather index_select index take zeros ones full empty zeros_like ones_like full_like empty_like arange "
            "to _to_copy type float half double int long bool repeat tile roll flip slice_scatter select_scatter "
            "index_put scatter masked_scatter channel_shuffle pixel_shuffle pixel_unshuffle new_zeros new_ones "
            "new_full new_empty tensor as_tensor",
}.items():
    for _name in _names.split():
        KIND_OF[_name] = _kind

KINDS = (*dict.fromkeys(KIND_OF.values()), "elementwise")


def short_name(target: str) -> str:
    """The last part of a target's name, lowercased: what the table is keyed by."""
    return target.rsplit(".", 1)[-1].lower()


def kind_of(target: str | None) -> str:
    """The kind of an op running ``target``: one of :data:`KINDS`."""
    return KIND_OF.get(short_name(target or ""), "elementwise")


def category_of(kind: str) -> str:
    """``compute`` (:data:`COMPUTE_KINDS`: the kernel's time grows with its FLOPs) or ``memory``."""
    return "compute" if kind in COMPUTE_KINDS else "memory"


def of(op: Any) -> str:
    """An op's kind: the one capture set, else its target's (a graph made by hand or loaded without kinds)."""
    return op.kind or kind_of(op.target)


__all__ = ["COMPUTE_KINDS", "KINDS", "KIND_OF", "category_of", "kind_of", "of", "short_name"]
