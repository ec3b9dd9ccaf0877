"""Make torchvision importable beside a CPU-only torch when its compiled extension does not load.

PyPI's Linux torchvision wheels are built against the CUDA build of torch: their ``_C`` library links
``libtorch_cuda.so``, which the CPU build of torch (``torch==2.13.0+cpu``) does not have. torchvision then carries on
without its C++ operators, except that its import registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` unconditionally, and that fails with ``RuntimeError: operator torchvision::nms does not exist``.
timm and transformers import torchvision when it is installed, so they fail too.

The fix a user can always make is the matching CPU build (``pip install torchvision==0.28.0 --index-url
https://download.pytorch.org/whl/cpu`` for torch 2.13). Where only PyPI's wheel can be had,
:func:`ensure_importable` is the workaround: it lets torchvision try first and, only when that fails on a missing
``torchvision::`` operator, defines the schemas of those two operators (no kernels) and imports torchvision again.
The classification models (convolutions, pooling, attention) do not use torchvision's C++ operators; the detection
operators (``nms``, ``roi_align``, ``deform_conv2d``) then raise torchvision's own "Couldn't load custom C++ ops".
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

# The schemas torchvision's ``_meta_registrations`` registers fake kernels for whether or not ``_C`` loaded (as in
# torchvision's csrc/ops/nms.cpp).
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # the torch.library.Library that holds the schemas, kept alive for the process


def ensure_importable() -> ModuleType | None:
    """Import torchvision (None when it is not installed), defining its missing operator schemas if its compiled
    extension failed to load (see the module docstring). Call it before importing timm or transformers."""
    global _library
    if "torchvision" in sys.modules:  # imported already (or stood in for)
        return sys.modules["torchvision"]
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as err:
        if "torchvision::" not in str(err) or _library is not None:
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # the failed import left half-initialised modules behind
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if not hasattr(torch.ops.torchvision, name):
            _library.define(schema)
    return importlib.import_module("torchvision")
