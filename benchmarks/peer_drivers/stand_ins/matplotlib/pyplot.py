"""Stand-in for matplotlib.pyplot (see the package's docstring)."""
from _stand_in import missing

__getattr__ = missing("matplotlib.pyplot")
