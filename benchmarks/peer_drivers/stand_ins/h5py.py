"""Stand-in for h5py, which PFLlib's servers import at load time and use only after the last
round, to write the accuracy history to a results file (``save_results``) and read it back
(``average_data``): the import works, a call says why it cannot. ``pfllib.py run`` reports the
rounds it measured when that bookkeeping stops on this stand-in."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(f"h5py.{name}: h5py is not installed here (a stand-in for PFLlib's FedAvg benchmark)")
