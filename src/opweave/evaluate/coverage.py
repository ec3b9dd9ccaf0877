"""Third-party model coverage: models from torchvision, timm and transformers (random weights, small configurations)
compiled by opweave under several schedulers and compared with eager on two inputs.

Used by ``tests/test_third_party.py`` (every model must pass) and ``benchmarks/coverage.py`` (the table and JSON).
One capture per model serves every scheduler (:func:`opweave.api.compile_captured`), as in ``opweave bench``.

Choices: images are 64x64 where the model allows it (32x32 for the small ViTs), transformers have 2 layers and a
hidden size of 64 or so, token sequences are 32 long; that keeps the whole list within a few minutes on two cores
while keeping every architectural feature (attention, relative position biases, rotary embeddings, squeeze-and-
excitation, channel shuffles, multi-branch stages). The second input is drawn like the first: normal floats, integers
uniform in the range the example input spans (token ids stay below the vocabulary size), booleans at random.
Outputs are compared by :func:`opweave.outputs.compare` held to :data:`TOLERANCE` (``1e-4``, stricter than float32's
``1e-3``): every tensor of the output structure within ``1e-4`` of eager's, relative to the largest magnitude of
eager's tensor (and at least absolute ``1e-4``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from opweave.errors import first_line
from opweave.outputs import compare

SCHEDULERS = ("sequential", "lios", "nimble", "opara", "hios-lp")
TOLERANCE = 1e-4

_TINY_TEXT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
              "vocab_size": 1000, "seq_len": 32}
_TINY_DECODER = {**_TINY_TEXT, "num_key_value_heads": 2, "max_position_embeddings": 64, "use_cache": False}
_TINY_VISION = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                "image_size": 32, "patch_size": 8}

# zoo name -> keyword arguments of opweave.zoo.create
MODELS: dict[str, dict[str, Any]] = {
    # torchvision: CNN families (residual, grouped, depthwise-separable, inverted residual + SE, channel shuffle,
    # dense, multi-branch inception, NAS-found, RegNet, ConvNeXt)
    "torchvision:resnet18": {"image_size": 64},
    "torchvision:resnet50": {"image_size": 64},
    "torchvision:resnext50_32x4d": {"image_size": 64},
    "torchvision:mobilenet_v2": {"image_size": 64},
    "torchvision:mobilenet_v3_small": {"image_size": 64},
    "torchvision:mobilenet_v3_large": {"image_size": 64},
    "torchvision:squeezenet1_1": {"image_size": 64},
    "torchvision:shufflenet_v2_x0_5": {"image_size": 64},
    "torchvision:mnasnet0_5": {"image_size": 64},
    "torchvision:efficientnet_b0": {"image_size": 64},
    "torchvision:googlenet": {"image_size": 64},
    "torchvision:inception_v3": {"image_size": 80},  # its smallest input is 75x75
    "torchvision:regnet_x_400mf": {"image_size": 64},
    "torchvision:convnext_tiny": {"image_size": 64},
    "torchvision:densenet121": {"image_size": 64},
    # timm: its tiny test networks (ViT, ConvNeXt, EfficientNet, BYOBNet, ResNet, NFNet, CoAtNet, MaxViT,
    # MambaOut) and small members of other families (HRNet's parallel branches, MobileViT, FastViT, EfficientViT)
    "timm:test_vit": {"image_size": 64},
    "timm:test_convnext": {"image_size": 64},
    "timm:test_efficientnet": {"image_size": 64},
    "timm:test_byobnet": {"image_size": 64},
    "timm:test_resnet": {"image_size": 64},
    "timm:test_nfnet": {"image_size": 64},
    "timm:test_coatnet": {},  # its relative position tables are sized for its default 160x160 input
    "timm:test_maxvit": {},
    "timm:test_mambaout": {"image_size": 64},
    "timm:resnet10t": {"image_size": 64},
    "timm:lcnet_050": {"image_size": 64},
    "timm:ghostnet_050": {"image_size": 64},
    "timm:hrnet_w18_small": {"image_size": 64},
    "timm:mobilevit_xxs": {"image_size": 64},
    "timm:fastvit_t8": {"image_size": 64},
    "timm:efficientvit_b0": {"image_size": 64},
    "timm:edgenext_xx_small": {"image_size": 64},
    "timm:poolformer_s12": {"image_size": 64},
    "timm:deit_tiny_patch16_224": {"img_size": 32, "depth": 2},
    # transformers: encoders, decoders, an encoder-decoder, vision and audio models; the attention each class
    # uses by default (sdpa for most). T5 at its default sizes, 2 layers, 32 tokens.
    "hf:T5EncoderModel": {"num_layers": 2, "seq_len": 32},
    "hf:BertModel": _TINY_TEXT,
    "hf:DistilBertModel": {"n_layers": 2, "dim": 64, "n_heads": 4, "hidden_dim": 128, "vocab_size": 1000,
                           "seq_len": 32},
    "hf:RobertaModel": {**_TINY_TEXT, "pad_token_id": 1},
    "hf:AlbertModel": {**_TINY_TEXT, "embedding_size": 32},
    "hf:ElectraModel": {**_TINY_TEXT, "embedding_size": 32},
    "hf:DebertaV2Model": _TINY_TEXT,
    "hf:MobileBertModel": {**_TINY_TEXT, "embedding_size": 32, "intra_bottleneck_size": 32,
                           "num_feedforward_networks": 2},
    "hf:GPT2Model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 64, "seq_len": 32,
                     "use_cache": False},
    "hf:LlamaModel": _TINY_DECODER,
    "hf:MistralModel": _TINY_DECODER,
    "hf:Qwen2Model": _TINY_DECODER,
    "hf:PhiModel": _TINY_DECODER,
    "hf:BartModel": {"encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_attention_heads": 4,
                     "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 1000,
                     "max_position_embeddings": 64, "seq_len": 32, "use_cache": False},
    "hf:ViTModel": _TINY_VISION,
    "hf:SwinModel": {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2],
                     "window_size": 4},
    "hf:ConvNextModel": {"image_size": 64, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1]},
    "hf:ResNetModel": {"image_size": 64, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1],
                       "embedding_size": 16},
    "hf:Wav2Vec2Model": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                         "conv_dim": [32, 32], "conv_stride": [5, 2], "conv_kernel": [10, 3],
                         "num_conv_pos_embeddings": 16, "seq_len": 1600},
}


def second_input(x: Any, generator: torch.Generator) -> Any:
    """Another input like ``x``: floats from a normal distribution, integers within ``x``'s range, random booleans."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.dtype == torch.bool:
        return torch.rand(x.shape, generator=generator) > 0.5
    if x.is_floating_point():
        return torch.randn(x.shape, generator=generator, dtype=x.dtype)
    low, high = (int(x.min()), int(x.max()) + 1) if x.numel() else (0, 1)
    return torch.randint(low, high, x.shape, generator=generator, dtype=x.dtype)


def check(name: str, schedulers: tuple[str, ...] = SCHEDULERS, **kwargs) -> dict:
    """Build and capture model ``name`` once (:func:`opweave.capture.load`, ``MODELS``' keyword arguments unless
    ``kwargs`` are given), compile it under each scheduler (``"default"``: what ``opweave.compile`` picks given
    none, the model itself among its candidates) and compare with eager on the example input and a second
    random one.

    Returns ``{"model", "ops", "capture_s", "error", "schedulers": {name: {"compile_s", "difference", "error"}}}``:
    ``ops`` of the captured graph (one per fx node; each compile coarsens it), ``capture_s`` the time to build and
    capture the model, ``difference`` the largest relative difference from eager; an ``error`` is the first line of
    what was raised (``None`` when it passed).
    """
    from opweave.api import compile_captured
    from opweave.capture import load

    row: dict[str, Any] = {"model": name, "ops": None, "capture_s": None, "error": None, "schedulers": {}}
    try:
        start = time.perf_counter()
        model, inputs, captured = load(name, coarsen=False, **(kwargs or MODELS.get(name, {})))
        row["capture_s"], row["ops"] = time.perf_counter() - start, len(captured.graph)
        generator = torch.Generator().manual_seed(1)
        cases = [inputs, tuple(second_input(x, generator) for x in inputs)]
        with torch.no_grad():
            expected = [model(*case) for case in cases]
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the table shows every model
        row["error"] = first_line(exc)
        return row
    for scheduler in schedulers:
        result: dict[str, Any] = {"compile_s": None, "difference": None, "error": None}
        try:
            start = time.perf_counter()
            how = {"eager": model} if scheduler == "default" else {"scheduler": scheduler}
            compiled = compile_captured(captured, inputs, **how)
            result["compile_s"] = time.perf_counter() - start
            checks = [compare(want, compiled(*case), tolerance=TOLERANCE)
                      for want, case in zip(expected, cases, strict=True)]
            result["difference"] = max(c.relative for c in checks)
            wrong = next((c for c in checks if not c.ok), None)
            if wrong is not None:
                result["error"] = f"differs from eager: {wrong.reason}"
        except Exception as exc:  # noqa: BLE001 - reported per scheduler
            result["error"] = first_line(exc)
        row["schedulers"][scheduler] = result
    return row
