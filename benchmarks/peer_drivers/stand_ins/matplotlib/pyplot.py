"""Stand-in for matplotlib.pyplot (see the package's docstring)."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(f"matplotlib.pyplot.{name}: matplotlib is not installed here (a stand-in for "
                              "PFLlib's FedAvg benchmark)")
