"""The stand-ins that let PFLlib's FedAvg run where its unused imports are missing
(benchmarks/peer_drivers/stand_ins, benchmarks/peers_setup.md section 5): importing works,
using anything says which module is missing, and the import machinery's dunder probes see
a plain missing attribute."""
import importlib.util
from pathlib import Path

import pytest

STAND_INS = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_drivers" / "stand_ins"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(f"_stand_in_{name.replace('.', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, path, attr", [
    ("h5py", STAND_INS / "h5py.py", "File"),
    ("torchvision", STAND_INS / "torchvision.py", "models"),
    ("matplotlib.pyplot", STAND_INS / "matplotlib" / "pyplot.py", "figure"),
])
def test_a_stand_in_imports_and_says_what_is_missing(name, path, attr, monkeypatch):
    monkeypatch.syspath_prepend(str(STAND_INS))  # as pfllib.py puts it on the path (their shared _stand_in)
    mod = load(name, path)
    with pytest.raises(NotImplementedError, match=rf"{name}\.{attr}: {name.split('.')[0]} is not installed here"):
        getattr(mod, attr)
    assert not hasattr(mod, "__path__")  # a probe of the import machinery: AttributeError, not the stand-in's error


def test_the_driver_names_every_stand_in_it_provides():
    src = (STAND_INS.parent / "pfllib.py").read_text()
    provided = {p.stem for p in STAND_INS.glob("*.py")} | {p.name for p in STAND_INS.iterdir() if p.is_dir()}
    provided = {n for n in provided if not n.startswith("_")}  # __pycache__, the shared _stand_in
    listed = src.split("STANDING_IN = (", 1)[1].split(")", 1)[0]
    assert provided == {n.strip().strip('"') for n in listed.split(",") if n.strip()}
