"""The model as the profiler measures it: whole on the device, or in shallow pieces.

A model trained sharded over several ranks may not fit the one device its profile runs on;
then, where its blocks are one container's uniform layers, it is measured on shallow
copies with 3 and then 4 of them (each on the device only while it is measured) and the
profile extended to its depth (:mod:`autotune.measure._depth`). Tuning and
:func:`autotune.estimate` both profile through this one choice.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from autotune._profile_data import Profile
from autotune.device import backend_for
from autotune.measure import deepen, shallow_copies

__all__ = ["Pieces"]

log = logging.getLogger("autotune")


class Pieces:
    """``model`` whole, or its shallow copies of 3 and 4 blocks where it does not fit.

    Args:
        model: The model (read only; ``whole`` makes the copy that runs).
        blocks: Its blocks.
        fits: Whether it fits the device whole (see
            :func:`~autotune.measure._depth.whole_fits`).
        device: The device measured on.
        whole: Makes the model that is measured whole, on the device (also where it does
            not fit but its blocks cannot be copied shallowly).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: tuple[str, ...],
        *,
        fits: bool,
        device: torch.device,
        whole: Callable[[], nn.Module],
    ) -> None:
        self.model, self.blocks, self.device, self._whole = model, blocks, device, whole
        self.copies = None if fits else shallow_copies(model, blocks)
        if not fits and self.copies is None:
            log.info("the blocks are not uniform layers: profiling the whole model")
        elif self.copies is not None:
            log.info("profiling copies with 3 and 4 of the %d blocks", len(blocks))

    @property
    def shallow(self) -> bool:
        """Whether the pieces are shallow copies (two of them), not the whole model."""
        return self.copies is not None

    def each(self) -> Iterator[tuple[nn.Module, tuple[str, ...]]]:
        """Each piece on the device, with its blocks: the whole model, or the copy of 3
        blocks and then the copy of 4 (the caller lets go of one before the next)."""
        if self.copies is None:
            yield self._whole(), self.blocks
            return
        for depth in (3, 4):
            copy, blocks = self.copies.copy(depth)
            yield copy.to(self.device), blocks
            del copy
            gc.collect()
            backend_for(self.device).empty_cache()

    def deepened(self, three: Profile, four: Profile) -> Profile:
        """The model's profile from its copies' (see :func:`~autotune.measure.deepen`)."""
        return deepen(three, four, self.model, self.blocks)
