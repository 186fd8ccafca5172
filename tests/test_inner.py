"""docs/non_sgd_updates.md: its example runs as printed, and the forged loss makes the
optimizer take the update the page states (sign-SGD), checked by hand on 2 parameters."""
import re

import torch
from torch import nn

from conftest import REPO


def page_example() -> dict:
    text = (REPO / "docs" / "non_sgd_updates.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)[1]
    scope: dict = {}
    exec(compile(code, "docs/non_sgd_updates.md", "exec"), scope)  # the page's own code, as printed
    return scope


def test_the_pages_sign_sgd_takes_the_sign_step_and_reports_the_loss():
    sign_sgd_loss = page_example()["sign_sgd_loss"]
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -1.0], [2.0, 0.25]]))
    x, y = torch.tensor([[1.0, 2.0], [-1.0, 0.5]]), torch.tensor([0, 1])
    w0 = model.weight.detach().clone()
    # by hand: f(w) = CE(x w^T, y), grad f = (softmax(x w^T) - onehot(y))^T x / 2
    p = torch.softmax(x @ w0.T, dim=1)
    f = -torch.log(p[torch.arange(2), y]).mean()
    g = (p - nn.functional.one_hot(y, 2).float()).T @ x / 2
    loss = sign_sgd_loss(model, x, y, {})
    assert torch.allclose(loss.detach(), f)  # the reported loss is f(w)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    loss.backward()
    assert torch.equal(model.weight.grad, torch.sign(g))  # the gradient is the direction, exactly
    opt.step()
    assert torch.allclose(model.weight.detach(), w0 - 0.1 * torch.sign(g))  # w - lr sign(grad f(w))
