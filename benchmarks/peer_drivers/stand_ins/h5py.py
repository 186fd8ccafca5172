"""Stand-in for h5py, which PFLlib's servers import at load time and use only after the last
round, to write the accuracy history to a results file (``save_results``) and read it back
(``average_data``): the import works, a call says why it cannot. ``pfllib.py run`` reports the
rounds it measured when that bookkeeping stops on this stand-in."""
from _stand_in import missing

__getattr__ = missing("h5py")
