"""protofl.nn.modes.eval_mode: eval inside the block, the earlier mode after it."""
import pytest
from torch import nn

from protofl.nn.modes import eval_mode


@pytest.mark.parametrize("training", [True, False])
def test_eval_inside_then_the_earlier_mode_even_after_an_error(training):
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model.train(training)
    with eval_mode(model) as m:
        assert m is model and not model.training and not model[1].training
    assert model.training is training and model[1].training is training
    with pytest.raises(RuntimeError), eval_mode(model):
        raise RuntimeError("boom")
    assert model.training is training and model[1].training is training
