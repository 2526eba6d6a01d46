"""accelerate: an ``Accelerator`` set as tuned (``pip install 'autotune[accelerate]'``).

>>> handle = autotune.apply(model, result, lr=3e-4)      # the mask, offload, the optimizer
>>> acc = accelerator(result)                             # precision and accumulation
>>> model, optimizer, loader = acc.prepare(model, handle.optimizer, loader)
>>> for batch in loader:                                  # DataLoader(batch_size=micro)
...     with acc.accumulate(model):
...         acc.backward(model(**batch).loss)
...         optimizer.step()
...         optimizer.zero_grad()

The ``Accelerator`` holds the precision (``mixed_precision``, with its GradScaler for
fp16) and the accumulation (``gradient_accumulation_steps``); :func:`autotune.apply`
holds the model-side knobs. accelerate's loop has no retry, so the fallback ladder does
not apply: a step that runs out of memory raises, as it would without autotune (for the
ladder, write the loop with the handle: :meth:`autotune.Applied.run`). An offloaded
optimizer goes through accelerate's DeepSpeed plugin (``autotune export --to
accelerate``), not through this function.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from autotune.errors import ConfigError
from autotune.integrations._export import to_accelerate
from autotune.result import TuneResult

__all__ = ["accelerator"]


def accelerator(result: TuneResult, **kwargs: Any) -> Accelerator:
    """An ``Accelerator`` with ``result``'s precision and accumulation, on the CPU when it
    was tuned there; ``kwargs`` go to ``Accelerator`` and win.

    Raises:
        ConfigError: ``result`` is not a :class:`TuneResult`, or it offloads the
            optimizer (which needs accelerate's DeepSpeed plugin).
    """
    if not isinstance(result, TuneResult):
        raise ConfigError(
            "accelerator() takes the TuneResult of autotune.autotune() or "
            f"autotune.load(path), got {type(result).__name__}."
        )
    c = result.config
    if c.offload_optimizer:
        raise ConfigError(
            "this result offloads the optimizer, which accelerate does through DeepSpeed: "
            "autotune export --to accelerate writes that config for accelerate launch."
        )
    exported = to_accelerate(result).settings  # the same settings as the exported file
    settings: dict[str, Any] = {
        "mixed_precision": exported["mixed_precision"],
        "gradient_accumulation_steps": c.grad_accum_steps,
    }
    if exported["use_cpu"]:
        settings["cpu"] = True
    return Accelerator(**{**settings, **kwargs})
