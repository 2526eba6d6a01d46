"""``Applied``: a :class:`TrainConfig` applied to a model, for any training loop.

The model-side knobs (the checkpoint mask, activation offload) are applied in place, and
the handle holds the rest of the config for the loop that trains: the micro-batch split
with exact mean-loss weights, autocast, fp16's GradScaler, the optimizer the config names
(offloaded to the host if it says so), and the fallback ladder on an out-of-memory error
(a :class:`~autotune.train._fallback.Ladder` the handle owns, which switches the handle's
config with :meth:`Applied.switch`).
:class:`~autotune.train._runner.Runner` is this handle plus a loss and a loop, so a loop
written with these pieces trains exactly as the runner does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from autotune.config import TrainConfig
from autotune.device import backend_for, resolve_device
from autotune.errors import ConfigError
from autotune.result import LengthRow
from autotune.train import _batch as batching
from autotune.train._attention import attention_of, set_attention
from autotune.train._checkpoint import (
    MODEL_FORWARD,
    apply_checkpointing,
    apply_offloading,
    check_blocks,
    named_recompute_errors,
    remove_checkpointing,
    replace_forward,
    restore_forwards,
)
from autotune.train._chunked_loss import (
    ChunkedLoss,
    chunked_loss,
    language_model,
    taking_chunked_loss,
)
from autotune.train._compiled import Recompiles, compile_blocks, is_compiled, uncompile_blocks
from autotune.train._compiled_model import CompiledLoss, ShapeRouted
from autotune.train._fallback import Ladder, snapshot
from autotune.train._loss import LossMean, counted_offset
from autotune.train._offload_activations import ActivationOffloader
from autotune.train._offload_optimizer import OptimizerOffloader
from autotune.train._optimizers import build_optimizer
from autotune.train._parallel import Parallel
from autotune.train._refusals import Refusals
from autotune.train._steps import Scheduler, apply_step, make_scaler

__all__ = ["Applied"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
T = TypeVar("T")


class Applied:
    """A config applied to a model: what a training loop needs to train as tuned.

    Attributes:
        model: The model, on ``device``, its blocks checkpointed and offloaded as configured.
        config: The configuration in use (a fallback after an out-of-memory error).
        fallbacks: Configurations still to fall back to, fastest first.
        device: Where the model trains.
        scaler: fp16's ``torch.amp.GradScaler``; ``None`` for fp32 and bf16.
    """

    compiles_loss = False
    """With ``compile_model``: whether the loss is compiled with the model (a runner, which
    takes the loss itself), rather than the model's forward alone (a loop of one's own)."""

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        *,
        lr: float | None,
        device: torch.device,
        fallbacks: Sequence[TrainConfig] = (),
        units: Sequence[str] = (),
        table: Sequence[LengthRow] = (),
        written: Sequence[str] | None = None,
        loss_mean: LossMean | None = None,
    ) -> None:
        every = (config, *fallbacks, *(c for r in table for c in (r.config, *r.fallbacks)))
        self.configs = every
        """Every config the handle may train with: the config, its fallbacks, the rows'."""
        for c in every:  # now, not at the first OOM in the middle of training
            check_blocks(model, c)
        for name in {c.attention for c in every if c.attention} - {attention_of(model)}:
            set_attention(model, name)()  # installed here: set, and put back
        self.model = model
        self.config = config
        self.device = device = resolve_device(device)
        self.backend = backend_for(device)
        self.lr = lr
        self.ladder = Ladder(config, fallbacks, table, written)
        """The fallback ladder: the fallbacks left, and the table's rows and row in use."""
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError("the model has no parameters that require grad: nothing to train.")
        self.host: OptimizerOffloader | None = None
        """The host side of an offloaded optimizer (``None`` without optimizer offload)."""
        self._optimizer: torch.optim.Optimizer | None = None
        self.scaler = make_scaler(config, device)
        self.refusals = Refusals(self.backend)
        """The steps refused for non-finite values, as the device's verdicts arrive."""
        self.recompiles = Recompiles()
        """Whether dynamo ran compiled code eagerly past its recompile limit: said once,
        after an optimizer step (a trainer's callback checks it after the trainer's)."""
        self.offloader = ActivationOffloader(model, device)
        self._undo: list[Callable[[], None]] = []
        self.attention_put_back: Callable[[], None] | None = None
        self.compiled_loss: CompiledLoss | None = None
        """The forward and loss compiled as one graph (``compile_model``): a runner's, or
        the chunked loss a loop of one's own takes."""
        chunks = not self.compiles_loss and any(c.chunked_loss for c in every)
        self.takes_chunked_loss = chunks and language_model(model) is not None
        """Whether in a loop of one's own ``model(**batch).loss`` is the chunked loss (no
        logits made) while a config with ``chunked_loss`` trains."""
        self._wrap(config)
        own = loss_mean is None and self._loss_fn() is None  # the model's own loss
        self.token_offset = counted_offset(model, loss_mean) if own or loss_mean else None
        """Where the loss is a mean over the counted label tokens (as ``loss_mean`` says,
        else where it is the model's own and that is one), the leading positions of each
        row's labels it never counts: micro-batches then weigh their tokens (``None``:
        their samples)."""
        self.parallel = Parallel(model, config, units, device)
        """The data parallelism: ``parallel.module`` is what a step calls (DDP's wrapper)."""
        self.params = [p for p in model.parameters() if p.requires_grad]  # FSDP's: shards
        self._closed = False
        self._budget = contextlib.ExitStack()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the config names, over the model's trainable parameters, built on
        first use (with an offloaded optimizer: over host master weights, stepped on the
        host by :meth:`optimizer_step`)."""
        if self._optimizer is None:
            self._optimizer = self._build_optimizer(self.config.offload_optimizer)
        return self._optimizer

    def _build_optimizer(self, offload: bool) -> torch.optim.Optimizer:
        name, lr = self.config.optimizer, self.lr
        if self.host is not None:
            self.host.close()
            self.host = None
        model, params = self.model, self.params
        if not offload or self.config.parallel == "fsdp":  # FSDP offloads by its own policy
            return build_optimizer(name, params, lr, model=model)

        def build(masters: list[torch.Tensor]) -> torch.optim.Optimizer:
            return build_optimizer(name, masters, lr, model=model, standing_for=params)

        self.host = OptimizerOffloader(params, self.device, build)
        return self.host.optimizer

    # --- the pieces of a training step --------------------------------------------------

    def micro_batches(self, batch: Any) -> Iterator[tuple[Any, float | torch.Tensor]]:
        """``(micro_batch, weight)`` pairs: ``batch`` in micro-batches of the config's size,
        each moved to the device, with its loss weight, so that the weighted losses add up
        to the mean loss over ``batch``: its share of the label tokens that count where
        the loss is a mean over them (``loss_mean``, or the model's own loss where that
        is one: a Hugging Face language model given ``labels``; a 0-dim tensor where the
        labels are on the device, counted without a read on the host), else of the
        samples (:func:`~autotune.train._batch.shares`).

        With an offloaded optimizer, the last micro-batch's backward sends the gradients
        to the host as it makes them; run each backward before taking the next pair.
        """
        for chunk, weight in self._chunks(batch):
            yield batching.to_device(chunk, self.device, non_blocking=True), weight

    def _chunks(self, batch: Any) -> Iterator[tuple[Any, float | torch.Tensor]]:
        """:meth:`micro_batches` where the batch is (the runner moves each one itself)."""
        self._check_open()
        self.select(batch)
        if self.backend.pins:  # pinned once a step: each micro-batch's copy runs async
            batch = batching.pinned(batch)
        chunks = batching.split(batch, self.config.micro_batch_size)
        ranks = self.parallel.mean_over_ranks if self.parallel.kind != "none" else None
        weights = batching.shares(batch, chunks, self.token_offset, ranks)
        for i, (chunk, weight) in enumerate(zip(chunks, weights, strict=True)):
            self.last_micro_batch(i == len(chunks) - 1)
            try:
                yield chunk, weight
            finally:
                self.last_micro_batch(False)

    def select(self, batch: Any) -> None:
        """With a table tuned per sequence length, train with the row of ``batch``'s
        length from now on (see :meth:`~autotune.train._fallback.Ladder.select`)."""
        self.ladder.select(self, batch)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context of the config's precision (a no-op for fp32)."""
        dtype = _DTYPES.get(self.config.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a (weighted) loss, scaled by the GradScaler for fp16.

        Raises:
            BlockError: a checkpointed block's recomputation differs from its forward.
        """
        with named_recompute_errors():
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()

    def optimizer_step(
        self, *, max_grad_norm: float | None = None, scheduler: Scheduler | None = None
    ) -> torch.Tensor | None:
        """Apply the accumulated gradients and free them.

        Args:
            max_grad_norm: Clip the gradients to this total 2-norm first (unscaled for
                fp16, on the host with an offloaded optimizer).
            scheduler: A learning-rate scheduler of :attr:`optimizer` that steps without
                arguments, stepped once after.

        Returns:
            The gradients' total norm before clipping, if ``max_grad_norm`` was given.

        Raises:
            NonFiniteError: a step was refused for non-finite gradients: the weights keep
                their last finite values. With a fused optimizer the device decides, and
                the host learns it without waiting: on the CPU in this call, on a GPU
                in one of the next two (the steps between are applied); see
                :meth:`check_steps`. Other optimizers are checked here, before they step.
        """
        self.ladder.stepping = True  # an OOM from here on is not retried
        optimizer = self.optimizer
        norm: list[torch.Tensor] = []

        def run(opt: torch.optim.Optimizer) -> None:
            norm.append(apply_step(opt, self.scaler, max_grad_norm, self.refusals))

        try:
            if self.host is not None:
                self.host.step(run)
            else:
                run(optimizer)
        except BaseException:
            self.refusals.drop()
            raise
        finally:
            self.zero_grad()  # a step refused for non-finite gradients leaves none behind
        if scheduler is not None:
            if scheduler.optimizer is not optimizer:
                # A fallback that moved the optimizer between host and device rebuilt it;
                # its learning rates came along in the state dict.
                scheduler.optimizer = optimizer
            scheduler.step()
        self.recompiles.check()
        self.refusals.end_step()
        return norm[0] if max_grad_norm is not None else None

    def check_steps(self) -> None:
        """Wait for the device's verdicts on the steps taken so far.

        Raises:
            NonFiniteError: one of them was refused for non-finite values (its weights
                were left as they were); said once.
        """
        self.refusals.check(wait=True)

    def zero_grad(self) -> None:
        """Free every gradient (on the host too, with an offloaded optimizer)."""
        if self.host is not None:
            self.host.zero_grad()
        elif self.parallel.keeps_gradients:
            # DDP's gradients are views of its buckets, which live anyway: zeroed, not freed.
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
        elif self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        else:
            for p in self.params:
                p.grad = None

    def last_micro_batch(self, last: bool) -> None:
        """Mark the coming backward as the step's last (offloaded optimizer: grads go down;
        DDP: gradients are reduced)."""
        if self.host is not None:
            self.host.collect = last
        self.parallel.last_micro_batch(last)

    # --- the fallback ladder (autotune.train._fallback), and switching config ----------

    @property
    def fallbacks(self) -> list[TrainConfig]:
        """The current config's fallbacks still left (its row's, with a table)."""
        return self.ladder.fallbacks

    def run(self, step: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``step(*args, **kwargs)``, one optimizer step, run again on a fallback after an
        out-of-memory error (see :meth:`~autotune.train._fallback.Ladder.run`)."""
        self._check_open()
        return self.ladder.run(self, step, *args, **kwargs)

    def switch(self, config: TrainConfig) -> None:
        """Train with ``config`` from the next step on, keeping weights and optimizer state.

        Raises:
            ConfigError: ``config`` names another optimizer (its state could not be kept).
        """
        if config.optimizer != self.config.optimizer:
            raise ConfigError(
                f"cannot switch from optimizer {self.config.optimizer} to {config.optimizer} "
                "mid-training; apply the new config to the model instead."
            )
        check_blocks(self.model, config)
        self.parallel.switch(config)
        self._wrap(config)
        if config.offload_optimizer != self.config.offload_optimizer:
            self.rebuild_optimizer(config.offload_optimizer)
        self.scaler = make_scaler(config, self.device, self.scaler)
        self.config = config

    def _wrap(self, config: TrainConfig) -> None:
        """The model-side knobs of ``config`` on the model: its blocks compiled, then
        checkpointed (fully or selectively) and offloaded, its attention implementation
        (put back by :meth:`undo`)."""
        model = self.model
        if config.attention is not None and config.attention != attention_of(model):
            put_back = set_attention(model, config.attention)  # first: it may refuse
            if self.attention_put_back is None:  # the model's own comes back at undo
                self.attention_put_back = put_back
                self.on_undo(put_back)
        remove_checkpointing(model)
        compiled = {n for n, m in model.named_modules() if is_compiled(m)}
        if compiled != set(config.compile_blocks):  # the compiled code is cached: no recompile
            uncompile_blocks(model)
            compile_blocks(model, config.compile_blocks)
        self._compile_model(config)
        apply_checkpointing(model, config.checkpoint, plain=config.compile_model)
        apply_checkpointing(model, config.selective_checkpoint, selective=True)
        apply_offloading(model, config.offload_activations, self.offloader)

    def _compile_model(self, config: TrainConfig) -> None:
        """The model compiled whole with its loss, where the handle takes the loss (a
        runner's) or the loss is chunked; and in a loop of one's own, the forward the loop
        calls: compiled whole (:class:`ShapeRouted`) and returning the chunked loss while
        it trains (:attr:`takes_chunked_loss`), as ``config`` says."""
        self.compiled_loss = None
        restore_forwards(self.model, MODEL_FORWARD)
        if config.compile_model and (self.compiles_loss or config.chunked_loss):
            dtype = _DTYPES.get(config.precision)
            self.compiled_loss = CompiledLoss(
                self.device.type, dtype, self._loss_fn(), chunked=config.chunked_loss
            )
        if self.compiles_loss or not (config.compile_model or self.takes_chunked_loss):
            return
        forward = self.model.forward
        if config.compile_model:
            forward = ShapeRouted(forward)
        if self.takes_chunked_loss:
            forward = taking_chunked_loss(self.model, forward, self.chunked_training_loss)
        replace_forward(self.model, forward, MODEL_FORWARD)

    def chunked_training_loss(self) -> ChunkedLoss | None:
        """The chunked loss a training forward returns under the config in force
        (:func:`~autotune.train._chunked_loss.taking_chunked_loss`): compiled with the model
        where the config compiles it, as tuned; ``None`` where the loss is not chunked."""
        if not self.config.chunked_loss:
            return None
        compiled = self.compiled_loss
        if compiled is None:
            return chunked_loss

        def compiled_chunked(
            model: nn.Module, batch: Any, num_items: torch.Tensor | int | None = None
        ) -> torch.Tensor:
            mean = compiled(model, batch)  # over the batch's counted tokens
            if num_items is None:
                return mean
            # Its sum over the step's tokens, outside the graph (a number passed into it
            # would compile a graph per value).
            summed = mean * batching.counted_tokens(batch, 1).clamp(min=1)
            return summed / num_items

        return compiled_chunked

    def _loss_fn(self) -> Any:
        """The loss function a compiled loss takes (a runner's)."""
        return None

    def snapshot(self) -> Callable[[], None]:
        """A function that puts the random state and the buffers a step writes back as
        they are now (see :func:`~autotune.train._fallback.snapshot`)."""
        return snapshot(self.model, self.backend, self.ladder.written)

    def rebuild_optimizer(self, offload: bool) -> None:
        """The optimizer built again on the host or the device, its state kept."""
        if self._optimizer is not None:
            # The state moves with a state dict: load_state_dict puts it where the new
            # optimizer's parameters are (host or device).
            state = self._optimizer.state_dict()
            self.zero_grad()
            self._optimizer = self._build_optimizer(offload)
            self._optimizer.load_state_dict(state)

    # --- the budget, and giving the model back ------------------------------------------

    def hold_budget(
        self, budget_bytes: int, *, context_bytes: int = 0, foreign_bytes: int = 0
    ) -> None:
        """Cap the device's caching allocator so that it and the context stay within
        ``budget_bytes`` until :meth:`close`, as verification did; ``foreign_bytes``, what
        the allocator holds for other tensors, comes on top. A device without a caching
        allocator is not capped."""
        if not self.backend.caching:
            return
        self._budget.close()
        self._budget.enter_context(self.backend.cap(budget_bytes - context_bytes + foreign_bytes))

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in :meth:`undo`, to put back a change made when applying."""
        self._undo.append(fn)

    def close(self) -> None:
        """Release what the handle holds on the model: gradients on both sides, the
        offloaded optimizer's gradient hooks (they keep its pinned host memory alive), the
        checkpoint and offload wrappers of the blocks, their compiled forwards, and the
        allocator's cap. The weights
        stay as trained. Closing twice is harmless; the handle cannot train after it.
        """
        self.zero_grad()
        for p in self.params:  # DDP's zeroed bucket views too
            p.grad = None
        if self.host is not None:
            self.host.close()
        remove_checkpointing(self.model)
        uncompile_blocks(self.model)
        restore_forwards(self.model, MODEL_FORWARD)
        self._budget.close()  # the allocator's cap as it was before
        self._closed = True

    def undo(self) -> None:
        """:meth:`close`, and put back what applying changed on the model (a Hugging Face
        ``config.use_cache``). The model stays on the device, its weights as trained."""
        self.close()
        while self._undo:
            self._undo.pop()()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this config was undone (or its runner closed); apply it again.")

    def __enter__(self) -> Applied:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()
