"""The calling convention and the loss (autotune.train._loss): how a batch is fed to the model and where the loss is found."""

from __future__ import annotations

from collections import UserDict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from autotune import TrainConfig, prepare
from autotune.errors import AutotuneError, LossError
from autotune.train._loss import call_model, compute_loss


class Recorder(nn.Module):
    """Returns how it was called: ``(args, kwargs)``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args, kwargs


X = torch.arange(6.0).reshape(3, 2)
Y = torch.tensor([0, 1, 0])


# --- call_model ------------------------------------------------------------------------------


@pytest.mark.parametrize("has_loss_fn", [False, True])
def test_tensor_batch_is_the_single_argument(has_loss_fn: bool) -> None:
    args, kwargs = call_model(Recorder(), X, has_loss_fn=has_loss_fn)
    assert len(args) == 1 and args[0] is X and kwargs == {}


@pytest.mark.parametrize("has_loss_fn", [False, True])
@pytest.mark.parametrize("kind", [dict, UserDict], ids=["dict", "mapping"])
def test_mapping_batch_is_keyword_arguments(kind: type, has_loss_fn: bool) -> None:
    batch = kind({"input_ids": X, "labels": Y})
    args, kwargs = call_model(Recorder(), batch, has_loss_fn=has_loss_fn)
    assert args == ()
    assert kwargs.keys() == {"input_ids", "labels"}  # labels go to the model, loss_fn or not
    assert kwargs["input_ids"] is X and kwargs["labels"] is Y


@pytest.mark.parametrize("kind", [tuple, list])
def test_sequence_batch_is_positional_arguments(kind: type) -> None:
    args, kwargs = call_model(Recorder(), kind([X, Y]), has_loss_fn=False)
    assert len(args) == 2 and args[0] is X and args[1] is Y and kwargs == {}


@pytest.mark.parametrize("kind", [tuple, list])
def test_sequence_batch_with_loss_fn_keeps_the_target_from_the_model(kind: type) -> None:
    args, _ = call_model(Recorder(), kind([X, X, Y]), has_loss_fn=True)
    assert len(args) == 2 and args[0] is X and args[1] is X


def test_one_element_sequence_with_loss_fn_still_feeds_the_model() -> None:
    args, _ = call_model(Recorder(), (X,), has_loss_fn=True)
    assert len(args) == 1 and args[0] is X


# --- compute_loss: where the loss is found --------------------------------------------------------


def test_scalar_output_is_the_loss() -> None:
    output = torch.tensor(2.5)
    assert compute_loss(output, X, None) is output


def test_one_element_output_becomes_a_zero_dim_loss() -> None:
    loss = compute_loss(torch.tensor([2.5]), X, None)
    assert loss.shape == () and loss.item() == 2.5


def test_output_loss_attribute_is_the_loss() -> None:
    output = SimpleNamespace(loss=torch.tensor(1.5), logits=torch.zeros(3, 4))
    assert compute_loss(output, X, None) is output.loss


def test_hugging_face_output_loss_is_the_loss() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    output = modeling_outputs.CausalLMOutput(loss=torch.tensor(0.75), logits=torch.zeros(3, 5))
    assert compute_loss(output, X, None) is output.loss


@pytest.mark.parametrize("kind", [tuple, list])
def test_first_element_of_a_sequence_output_is_the_loss(kind: type) -> None:
    loss = torch.tensor(3.0)
    assert compute_loss(kind([loss, torch.zeros(3, 4)]), X, None) is loss


def test_loss_fn_gets_output_and_batch_and_takes_precedence() -> None:
    seen: list[Any] = []
    result = torch.tensor(9.0)

    def loss_fn(output: Any, batch: Any) -> torch.Tensor:
        seen.append((output, batch))
        return result

    output = SimpleNamespace(loss=torch.tensor(1.0))  # ignored: loss_fn decides
    batch = (X, Y)
    assert compute_loss(output, batch, loss_fn) is result
    assert len(seen) == 1 and seen[0][0] is output and seen[0][1] is batch


def test_loss_keeps_its_graph() -> None:
    w = torch.ones(2, requires_grad=True)
    loss = compute_loss((X @ w).mean(), X, None)
    loss.backward()
    torch.testing.assert_close(w.grad, X.mean(0))


# --- compute_loss: errors ----------------------------------------------------------------------


def test_non_scalar_output_without_loss_fn_is_a_loss_error() -> None:
    with pytest.raises(LossError) as info:
        compute_loss(torch.zeros(3, 4), X, None)
    message = str(info.value)
    assert "(3, 4)" in message and "loss_fn" in message
    assert isinstance(info.value, AutotuneError)


def test_hugging_face_output_without_labels_says_to_pass_labels() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    output = modeling_outputs.CausalLMOutput(loss=None, logits=torch.zeros(3, 5))
    with pytest.raises(LossError, match="labels"):
        compute_loss(output, {"input_ids": Y}, None)


def test_output_with_loss_none_says_to_pass_labels() -> None:
    with pytest.raises(LossError, match="labels"):
        compute_loss(SimpleNamespace(loss=None, logits=torch.zeros(2)), X, None)


@pytest.mark.parametrize(
    ("returned", "described"),
    [
        (torch.zeros(3), "shape (3,)"),
        (2.0, "float"),
        (torch.tensor(1), "torch.int64"),
    ],
    ids=["vector", "python-float", "integer-tensor"],
)
def test_loss_fn_returning_a_non_scalar_is_a_loss_error(returned: Any, described: str) -> None:
    with pytest.raises(LossError, match="loss_fn returned") as info:
        compute_loss(torch.tensor(1.0), X, lambda output, batch: returned)
    assert described in str(info.value)


@pytest.mark.parametrize(
    ("output", "described"),
    [
        ((torch.zeros(3, 4), torch.tensor(1.0)), "tuple of 2 items"),
        ([], "list of 0 items"),
        (torch.tensor(3), "torch.int64"),  # an integer is no loss to differentiate
        ({"loss": torch.tensor(1.0)}, "type dict"),
    ],
    ids=["tuple-without-leading-loss", "empty-list", "integer", "plain-dict"],
)
def test_outputs_without_a_loss_are_loss_errors(output: Any, described: str) -> None:
    with pytest.raises(LossError, match="cannot derive a loss") as info:
        compute_loss(output, X, None)
    assert described in str(info.value)
    assert "labels" not in str(info.value)  # the labels hint is only for a .loss of None


# --- the conventions in a training step -------------------------------------------------------------


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(2, 1)
        self.inputs: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.shape[0])
        return self.linear(x).squeeze(1)


def test_runner_feeds_x_and_loss_fn_reads_y() -> None:
    model = Regressor()
    x, y = torch.randn(6, 2), torch.randn(6)

    def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
        return (output - batch[1]).square().mean()

    runner = prepare(model, TrainConfig(micro_batch_size=4), lr=0.1, loss_fn=loss_fn, device="cpu")
    with torch.no_grad():
        expected = loss_fn(model(x), (x, y))
    model.inputs.clear()
    loss = runner.step((x, y))
    assert model.inputs == [4, 2]  # the model saw only x, in micro-batches
    torch.testing.assert_close(loss, expected)


def test_runner_accepts_a_one_element_loss() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).mean().reshape(1)  # shape (1,), as some wrappers return

    runner = prepare(Model(), TrainConfig(micro_batch_size=2), device="cpu")
    loss = runner.step(torch.randn(4, 2))
    assert loss.shape == () and torch.isfinite(loss)
