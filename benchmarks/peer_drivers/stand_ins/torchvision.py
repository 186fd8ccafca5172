"""Stand-in for torchvision, which PFLlib's main.py imports at load time and uses only for the
ResNet and GoogLeNet models (the FedAvg benchmark trains its MNIST CNN): the import works,
anything used from it says why it cannot."""
from _stand_in import missing

__getattr__ = missing("torchvision")
