"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov & Morency, 2020,
"Think Locally, Act Globally: Federated Learning with Local and Global Representations",
arXiv:2001.01523), Algorithm 1: local representations, a global head -- the opposite
split of FedPer.

    server: send the global layers theta^g_t (the head) to the sampled clients S_t
    client m: model = (own local layers theta^l_m, theta^g_t); E epochs of SGD on CE over
              both parts (end-to-end, the paper's supervised variant); reply theta^g_m,
              keep theta^l_m
    server: theta^g_{t+1} = sum_m (n_m / n) theta^g_m   over the replies

Shared: ``model.head`` (the last linear layer of every protofl model); personal:
``model.body``, kept in the client's state Record (the run's initial body for a client
never sampled). Personalized model: the client's body + the head after local training.
No global model (each client has its own representation): GA is the mean accuracy of
the personalized models on the global test set; the paper's "global" test of new
devices (an ensemble of local models) is not reported.

Choices and deviations:
* The paper's global layers are the top layers of the network (its number varies by
  dataset); here exactly ``model.head``, as PFLlib's LG-FedAvg. (The authors' CIFAR CNN
  lists its ``weight_keys`` fully connected layers first and the code makes the last
  ``--num_layers_keep`` entries global, so their CIFAR command's ``--num_layers_keep 2``
  makes conv1 and conv2 global and the fully connected layers local, the opposite of the
  paper: their issue #8. protofl follows the paper.)
* The authors' code (github.com/pliang279/LG-FedAvg, ``main_lg.py``) starts every local
  model from a FedAvg-trained network (``--load_fed``) and averages the global layers
  uniformly (1/m); here training starts from the run's initialization, and the average
  is FedAvg's (``weighting: samples``; ``uniform`` is the code's).
* The code picks each client's best local model by its test accuracy; not done here.
* The paper's auxiliary unsupervised / fair representation objectives for the local
  layers are not implemented (its supervised variant trains them on the task loss).
"""
from __future__ import annotations

from .base import register, WeightsState
from .fedper import FedPer


@register
class LGFedAvg(FedPer[WeightsState]):
    name = "lgfedavg"
    personal_prefixes = ("body.",)  # the local representation; the head is global
