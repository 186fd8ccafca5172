"""What the stand-ins share: a module's ``__getattr__`` under which importing the module works
and using anything from it says which package is missing (the import machinery's dunder
probes see a plain missing attribute)."""


def missing(module: str):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"{module}.{name}: {module.split('.')[0]} is not installed here (a stand-in for "
                                  "PFLlib's FedAvg benchmark)")
    return __getattr__
