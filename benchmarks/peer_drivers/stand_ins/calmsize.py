"""Stand-in for calmsize, which PFLlib's main.py imports at load time (``from calmsize import
size`` in its memory reporter, which FedAvg's benchmark runs never print): the import works,
a call says why it cannot."""


def size(num_bytes):
    raise NotImplementedError("calmsize is not installed here (a stand-in for PFLlib's FedAvg benchmark)")
