"""Let PyPI's torchvision import next to the CPU build of torch 2.13.

PyPI's Linux torchvision wheels are linked against CUDA torch (libc10_cuda.so). Next to
the CPU torch their C++ operators do not load, which torchvision tolerates except for
two unconditional fake-tensor registrations (``torchvision::nms`` and ``qnms``), so
``import torchvision`` fails. The peers only use torchvision's datasets (MNIST) and
transforms, pure Python. benchmarks/peers.py puts this folder on PYTHONPATH for the
peers' processes (Ray's workers inherit it): when torchvision is first imported and its
operators cannot load, the two schemas are defined first (never called).
"""
import importlib.abc
import sys


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import ctypes
        import importlib.util
        import os

        import torch

        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:  # absent, or a one-file stand-in
            return spec
        lib = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
        try:
            ctypes.CDLL(lib)
        except OSError:
            ops = torch.library.Library("torchvision", "FRAGMENT")
            ops.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            ops.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
            sys.modules["_cpu_torchvision_ops"] = ops  # keep the library alive
        return spec


sys.meta_path.insert(0, _Finder())
