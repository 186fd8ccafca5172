"""Stand-in for torchvision, which PFLlib's main.py imports at load time and uses only for the
ResNet and GoogLeNet models (the FedAvg benchmark trains its MNIST CNN): the import works,
anything used from it says why it cannot."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(f"torchvision.{name}: torchvision is not installed here (a stand-in for PFLlib's "
                              "FedAvg benchmark)")
