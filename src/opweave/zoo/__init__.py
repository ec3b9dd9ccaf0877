"""The built-in model zoo: the networks the papers measure (IOS among them), as plain PyTorch modules, random weights.

    model, inputs = opweave.zoo.create("inception_v3", batch_size=1)
    model(*inputs)

Nothing is downloaded. Weights and inputs are seeded (``torch.manual_seed(0)`` for the weights, a private generator
seeded with 0 for the inputs, the caller's RNG state left untouched), so two calls give the same model and inputs.
The model comes back in ``eval()`` mode and every built-in forward is ``torch.fx.symbolic_trace``-able.

The BatchNorm running statistics of the built-in models are calibrated on one fixed random batch (independent of
``batch_size``): with freshly initialised statistics (mean 0, variance 1) a deep random network's activations shrink
or blow up layer after layer until its output hardly depends on its input, and then a wrongly wired schedule could
still match eager. Calibrated, every BatchNorm output has unit scale, as in a trained network.

Built-in names (``names()``): inception_v3, googlenet, squeezenet, resnet50, nasnet_a_mobile, randwire, bert_base,
deepfm. Keyword arguments go to the model's module-level ``create`` (e.g. ``num_layers=2`` for bert_base,
``bypass="complex"`` for squeezenet, ``regime="regular"`` for randwire, ``image_size=...`` for the CNNs).

Prefixed names reach other libraries, which are then required (``ImportError`` naming the package otherwise):

* ``"torchvision:<name>"``: ``torchvision.models.<name>(weights=None)``; 299x299 input for inception_v3, 224 else;
* ``"timm:<name>"``: ``timm.create_model(name, pretrained=False, **kwargs)``, input size ``image_size`` (or
  ``img_size``, which timm's ViTs take) else from its pretrained config;
* ``"hf:<model-id>"``: a Hugging Face ``AutoModel`` built with ``AutoModel.from_config`` from a configuration made
  locally (``AutoConfig.for_model``), never fetched, so only the ids in ``HF_CONFIGS`` are known; or
  ``"hf:<ModelClass>"``, any transformers model class (``hf:T5EncoderModel``) built from its configuration class.
  Keyword arguments other than ``seq_len`` (default 128) override configuration fields (e.g.
  ``num_hidden_layers=2``). Input: random token ids (or images, or audio samples, by the class's
  ``main_input_name``). Hugging Face models return a ``ModelOutput``.

torchvision's PyPI wheel does not import beside the CPU build of torch; the prefixed names first make it importable
(:mod:`.torchvision_cpu`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opweave.errors import MissingPackageError, UsageError, did_you_mean
from opweave.zoo.torchvision_cpu import ensure_importable as ensure_torchvision_importable

# Built-in name -> module of this package whose ``create(batch_size, **kwargs)`` builds it.
_BUILTIN = {
    "inception_v3": "inception_v3",
    "googlenet": "googlenet",
    "squeezenet": "squeezenet",
    "resnet50": "resnet50",
    "nasnet_a_mobile": "nasnet",
    "randwire": "randwire",
    "bert_base": "bert",
    "deepfm": "deepfm",
}

# Operator and edge counts of the computation graphs as the papers report them, for documentation. The papers count
# coarser operators than an fx graph (a conv with its BN and ReLU is one operator, a Fire module's concat one more),
# and the IOS benchmark's NASNet-A and RandWire are the large variants (IOS's ``nasnet_large``, ``randwire_large`` =
# our ``randwire`` with ``regime="regular"``), so a captured zoo graph is not expected to match these numbers.
PAPER_COUNTS: dict[str, dict] = {
    "inception_v3": {"ops": 119, "edges": 153, "blocks": 13,
                     "source": "IOS benchmark; LIOS Table IV, HIOS Sec. V; TOP Table II (ops, blocks)"},
    "nasnet_a_mobile": {"ops": 374, "edges": 576, "source": "IOS benchmark NASNet-A (large); LIOS Table IV, HIOS"},
    "randwire": {"ops": 120, "edges": 260, "source": "IOS benchmark RandWire (regular regime); LIOS Table IV"},
    "squeezenet": {"ops": 50, "edges": 65, "blocks": 12,
                   "source": "IOS benchmark SqueezeNet (complex bypass); LIOS Table IV; TOP Table II (blocks)"},
    "resnet50": {"ops": 87, "edges": None, "blocks": 5, "source": "TOP Table II"},
}

# Operator and edge counts of each model's graph as opweave schedules it (captured at batch 1 and coarsened, as
# ``opweave.compile`` plans it; ``opweave models`` shows them beside the papers'); a test recaptures them.
COUNTS: dict[str, tuple[int, int]] = {
    "inception_v3": (124, 158), "googlenet": (81, 107), "squeezenet": (38, 45), "resnet50": (60, 75),
    "nasnet_a_mobile": (620, 775), "randwire": (473, 596), "bert_base": (141, 188), "deepfm": (71, 72),
}

# Hugging Face ids known without network access: id -> (model_type for AutoConfig.for_model, config overrides).
_BERT_LARGE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096}
_ROBERTA = {"vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1, "pad_token_id": 1,
            "bos_token_id": 0, "eos_token_id": 2, "layer_norm_eps": 1e-5}
HF_CONFIGS: dict[str, tuple[str, dict]] = {
    "bert-base-uncased": ("bert", {}),
    "google-bert/bert-base-uncased": ("bert", {}),
    "bert-base-cased": ("bert", {"vocab_size": 28996}),
    "bert-large-uncased": ("bert", _BERT_LARGE),
    "google-bert/bert-large-uncased": ("bert", _BERT_LARGE),
    "distilbert-base-uncased": ("distilbert", {}),
    "roberta-base": ("roberta", _ROBERTA),
    "FacebookAI/roberta-base": ("roberta", _ROBERTA),
    "gpt2": ("gpt2", {}),
    "openai-community/gpt2": ("gpt2", {}),
}

def names() -> list[str]:
    """Built-in model names (the prefixed families are open-ended and not listed)."""
    return list(_BUILTIN)


def is_model(name: str) -> bool:
    """Whether ``name`` names a model :func:`create` builds: a built-in one, or one with a known prefix
    (``torchvision:``, ``timm:``, ``hf:``) whose name after it is not checked until it is built.

    >>> is_model("googlenet"), is_model("timm:resnet18"), is_model("lios-fig3")
    (True, True, False)
    """
    prefix, sep, rest = name.partition(":")
    return name in _BUILTIN or bool(sep and rest) and prefix in _EXTERNAL


def check(name: str) -> None:
    """A :class:`~opweave.errors.UsageError` for a name that is not a model (:func:`is_model`), with the name it was
    likely meant to be: what a door that takes model names checks before it builds any."""
    if not is_model(name):
        rest = name.partition(":")[2]
        hint = did_you_mean(name, names()) or did_you_mean(name, [f"{p}:{rest}" for p in _EXTERNAL])
        raise UsageError(f"unknown model {name!r}{hint}; built-in models: {', '.join(names())}; or use a prefix: "
                         f"{', '.join(p + ':<name>' for p in _EXTERNAL)}")


def takes_image_size(name: str) -> bool:
    """Whether ``create(name, image_size=...)`` applies: the built-in CNNs, ``torchvision:`` and ``timm:`` models,
    and ``hf:`` ones (where it is a configuration field); not deepfm and bert_base, nor an unknown name.

    >>> takes_image_size("squeezenet"), takes_image_size("deepfm"), takes_image_size("bert_base")
    (True, False, False)
    """
    if name in _BUILTIN:
        return "image_size" in inspect.signature(_builtin(name)).parameters
    return name.partition(":")[0] in _EXTERNAL


def _builtin(name: str):
    """The ``create(batch_size, **kwargs)`` of built-in model ``name``."""
    return importlib.import_module(f"{__name__}.{_BUILTIN[name]}").create


def create(name: str, batch_size: int = 1, **kwargs) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build model ``name`` with seeded random weights, in eval mode, and a batch of example inputs for it."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    check(name)
    prefix, _, external_name = name.partition(":")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name in _BUILTIN:
            model, inputs = _builtin(name)(batch_size, **kwargs)
            _calibrate_batchnorm(model, inputs)
        else:
            model, inputs = _EXTERNAL[prefix](external_name, batch_size, **kwargs)
    return model.eval(), inputs


def _calibrate_batchnorm(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Set every BatchNorm's running mean/variance to the statistics of one fixed random batch of two samples."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms or not all(x.is_floating_point() for x in inputs):
        return
    generator = torch.Generator().manual_seed(1)
    batch = tuple(torch.randn(2, *x.shape[1:], generator=generator, dtype=x.dtype) for x in inputs)
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average: after one batch, exactly that batch's statistics
    model.train()
    with torch.no_grad():
        model(*batch)
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum


def _require(package: str, name: str):
    """Import ``package`` (torchvision, timm, transformers), torchvision first made importable beside a CPU-only torch
    (:mod:`.torchvision_cpu`): timm and transformers import it too."""
    try:
        ensure_torchvision_importable()
        return importlib.import_module(package)
    except ImportError as err:
        if err.name != package:  # installed, but one of its own dependencies is missing
            raise MissingPackageError(f"{package} could not be imported ({err}); it is needed for {name!r}") from err
        raise MissingPackageError(f"{package} is not installed; `pip install {package}` to use {name!r}") from err


def _images(batch_size: int, size: tuple[int, ...]) -> tuple[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, *size, generator=generator),)


def _torchvision(name: str, batch_size: int, image_size: int | None = None, **kwargs):
    models = _require("torchvision", f"torchvision:{name}").models
    builder = getattr(models, name, None)
    if builder is None or not callable(builder) or name.startswith("_"):
        known = models.list_models() if hasattr(models, "list_models") else []
        raise UsageError(f"torchvision.models has no model {name!r}{did_you_mean(name, known)}")
    if name in ("googlenet", "inception_v3"):  # aux classifiers only run in training; explicit init avoids a warning
        kwargs = {"aux_logits": False, "init_weights": True, **kwargs}
    model = builder(weights=None, **kwargs)
    size = image_size or (299 if name == "inception_v3" else 224)
    return model, _images(batch_size, (3, size, size))


def _timm(name: str, batch_size: int, image_size: int | None = None, **kwargs):
    timm = _require("timm", f"timm:{name}")
    model = timm.create_model(name, pretrained=False, **kwargs)
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    channels, height, width = tuple(cfg.get("input_size", (3, 224, 224)))
    size = image_size or kwargs.get("img_size")
    return model, _images(batch_size, (channels, size, size) if size else (channels, height, width))


def _huggingface(model_id: str, batch_size: int, seq_len: int = 128, attn_implementation: str | None = None,
                 **overrides):
    """``hf:<id>`` for the ids in ``HF_CONFIGS`` (``AutoModel``, eager attention: matmul and softmax stay visible
    ops), or ``hf:<ModelClass>``, any transformers model class (``T5EncoderModel``, ``ViTModel``, ...) built from its
    own configuration class with ``overrides`` and the attention a user gets by default (``sdpa`` where the class
    has it). The input is what the class's ``main_input_name`` says: token ids below ``vocab_size``, or images of the
    configuration's ``num_channels`` and ``image_size``, or ``seq_len`` audio samples."""
    transformers = _require("transformers", f"hf:{model_id}")
    cls: Any = getattr(transformers, model_id, None) if model_id[:1].isupper() else None
    if model_id in HF_CONFIGS:
        model_type, defaults = HF_CONFIGS[model_id]
        config = transformers.AutoConfig.for_model(model_type, **{**defaults, **overrides})
        build = transformers.AutoModel.from_config
        attn_implementation = attn_implementation or "eager"
    elif isinstance(cls, type) and hasattr(cls, "config_class"):
        model_class: Any = cls  # a transformers model class: its config class and its own constructor from one
        config = model_class.config_class(**overrides)
        build = model_class._from_config
    else:
        raise UsageError(f"unknown Hugging Face id {model_id!r}{did_you_mean(model_id, HF_CONFIGS)} (configs are "
                         "built locally, without network); "
                         f"known ids: {', '.join(HF_CONFIGS)}, or a transformers model class such as T5EncoderModel")
    try:
        model = build(config, attn_implementation=attn_implementation) if attn_implementation else build(config)
    except (TypeError, ValueError):  # transformers older than 4.36, or a model without that choice
        model = build(config)
    generator = torch.Generator().manual_seed(0)
    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input == "pixel_values":
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        return model, (torch.randn(batch_size, config.num_channels, size, size, generator=generator),)
    if main_input == "input_values":
        return model, (torch.randn(batch_size, seq_len, generator=generator),)
    return model, (torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator),)


_EXTERNAL: dict[str, Callable[..., tuple[nn.Module, tuple]]] = {"torchvision": _torchvision, "timm": _timm,
                                                                 "hf": _huggingface}
