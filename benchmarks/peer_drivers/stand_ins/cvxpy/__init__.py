"""Stand-in for cvxpy, which PFLlib's main.py imports (through a method FedAvg never runs):
importing it works, using anything in it says why it is missing."""


def __getattr__(name):
    raise ImportError(f"cvxpy.{name}: cvxpy is not installed here (a stand-in for PFLlib's FedAvg, which never uses it)")
