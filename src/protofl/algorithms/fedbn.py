"""FedBN (Li, Jiang, Zhang, Kamp & Dou, ICLR 2021, "FedBN: Federated Learning on Non-IID
Features via Local Batch Normalization"), Algorithm 1: FedAvg in which every BatchNorm
layer stays on its client.

    server: send w_t, without its BatchNorm entries, to the sampled clients S_t
    client k: model = (w_t, own BatchNorm layers b_k); E epochs of SGD on CE over all
              parameters; reply everything but b_k, keep b_k
    server: w_{t+1} = sum_k (n_k / n) w_k   over the replies, BatchNorm entries excluded

The split is FedPer's (``fedper.py``) with the personal part chosen by module type:
every state-dict entry of a ``BatchNorm1d/2d/3d`` (or ``SyncBatchNorm``) module -- its
affine parameters gamma, beta and its running statistics mu, sigma^2 and
``num_batches_tracked`` -- is personal, kept in the client's state Record (a client never
sampled starts from the run's initial BatchNorm layers). Personalized model: the
client's model after local training, with its own BatchNorm layers. No global model (the
server has no BatchNorm layers of its own): GA is the mean accuracy of the personalized
models on the global test set.

Choices where the paper is silent, and deviations:
* The authors' code (github.com/med-air/FedBN, ``communication``) keeps local every entry
  whose *name* contains "bn"; here the layers are found by their type, so a model need
  not name them (protofl's ``lenet5`` and ``resnet18`` do not all do).
* ``weighting``: FedAvg's n_k-weighted mean by default (the box above); the authors'
  code averages with ``client_weights`` = 1/K over all K clients (every client takes part
  every round): ``weighting: uniform`` reproduces it.
* A model without BatchNorm (``mlp``, ``cnn_mnist``) has no personal part: FedBN is then
  FedAvg without a reported global model.
* The paper targets feature shift (its digits benchmark: MNIST, SVHN, USPS, SynthDigits,
  MNIST-M, one domain per client); under pure label skew its local statistics differ only
  through the class mix.
"""
from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .base import register, WeightsState
from .fedper import FedPer


def batchnorm_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The state-dict prefixes ("body.1.") of the model's BatchNorm layers."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, _BatchNorm))


@register
class FedBN(FedPer[WeightsState]):
    name = "fedbn"
    has_global_model = False
    personal_prefixes: tuple[str, ...] = ()  # set from the architecture by adapt_model

    def adapt_model(self, model: nn.Module) -> nn.Module:
        # every process builds its model (server and clients alike) before it splits a state
        # dict, so the split is known wherever ``is_personal`` runs
        self.personal_prefixes = batchnorm_prefixes(model)
        return model
