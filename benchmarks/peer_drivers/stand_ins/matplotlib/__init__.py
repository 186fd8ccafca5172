"""Stand-in for matplotlib, which PFLlib imports (``utils/dlg.py``, its gradient-inversion
check, off by default) at load time: the import works, anything used from it says why it cannot."""
