"""DiLoCo's outer Nesterov step against a hand-computed reference and torch's SGD."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from p2ptrain.train.outer import OuterNesterov, all_finite


def test_two_steps_by_hand() -> None:
    outer = OuterNesterov(torch.tensor([1.0, 2.0]), lr=0.5, momentum=0.9)
    outer.step(torch.tensor([0.1, -0.2]))
    # m = Δ = [0.1, -0.2]; update = Δ + 0.9·m = [0.19, -0.38]; θ = θ - 0.5·update
    torch.testing.assert_close(outer.params, torch.tensor([0.905, 2.19]))
    outer.step(torch.tensor([0.1, 0.1]))
    # m = 0.9·[0.1, -0.2] + [0.1, 0.1] = [0.19, -0.08]; update = [0.271, 0.028]
    torch.testing.assert_close(outer.momentum_buffer, torch.tensor([0.19, -0.08]))
    torch.testing.assert_close(outer.params, torch.tensor([0.7695, 2.176]))


def test_matches_torch_sgd_nesterov() -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=generator)
    outer = OuterNesterov(start, lr=0.7, momentum=0.9)
    param = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        delta = torch.randn(1000, generator=generator)
        outer.step(delta)
        param.grad = delta.clone()
        sgd.step()
    torch.testing.assert_close(outer.params, param.detach(), rtol=1e-6, atol=1e-6)


def test_pseudo_gradient_and_plain_momentum() -> None:
    outer = OuterNesterov(torch.tensor([1.0, 1.0]), lr=1.0, momentum=0.5, nesterov=False)
    delta = outer.pseudo_gradient(torch.tensor([0.75, 1.5]), out=torch.empty(2))
    torch.testing.assert_close(delta, torch.tensor([0.25, -0.5]))
    outer.step(delta)  # without Nesterov, θ moves by lr·m: back to the inner params on the first step
    torch.testing.assert_close(outer.params, torch.tensor([0.75, 1.5]))
    assert outer.params_hash() != OuterNesterov(torch.tensor([1.0, 1.0]), lr=1.0, momentum=0.5).params_hash()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_one_nan_or_inf_anywhere(bad: float) -> None:
    vector = torch.full((1001,), -3.0e38)  # huge but finite values are finite
    assert all_finite(vector)
    for index in (0, 500, 1000):
        spoiled = vector.clone()
        spoiled[index] = bad
        assert not all_finite(spoiled)


def test_the_params_hash_is_the_sha256_of_the_params_bytes() -> None:
    outer = OuterNesterov(torch.arange(10, dtype=torch.float32), lr=0.7, momentum=0.9)
    assert outer.params_hash() == hashlib.sha256(outer.params.numpy().tobytes()).hexdigest()
