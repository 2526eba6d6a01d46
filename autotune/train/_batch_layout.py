"""``BatchLayout``: how a batch whose samples are not rows of dimension 0 is counted, cut
and grown.

Most batches hold one sample per row of every tensor, and :mod:`autotune.train._batch`
cuts and grows them along dimension 0. Some do not: padding-free packing puts a batch's
sequences end to end in one row, told apart by ``position_ids`` that start again at 0
(:class:`PackedSequences`, TRL's ``bfd`` packing); a vision-language batch holds every
image's patches in one tensor, with each image's grid (:class:`ImagePatches`, Qwen2-VL's
``pixel_values`` and ``image_grid_thw``); a detection batch holds a list of images of
different sizes and a list of target dicts (:class:`SampleLists`, torchvision's
``(images, targets)``). A layout says how many samples such a batch holds, takes a range
of them and joins batches, and what each part's loss weighs in the whole's mean; the
profiler, the verifier, the runner's micro-batches and the trainers' callbacks all cut
batches through :func:`layout_of`. Layouts of the user's (:func:`add_batch_layout`) are
tried first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from autotune.errors import BatchError

__all__ = [
    "BatchLayout",
    "ImagePatches",
    "PackedSequences",
    "SampleLists",
    "add_batch_layout",
    "layout_of",
    "layouts_of_model",
    "on_host",
]


class BatchLayout:
    """How batches of one structure hold their samples. Subclass it and pass an instance
    to :func:`autotune.add_batch_layout`."""

    pads = False
    """Whether a model pads a micro-batch of these to its widest sample (a detection
    model's images): then every micro-batch is measured at the widest of the sample
    (:meth:`widest_first`), what the job's micro-batches cost at most."""

    def recognises(self, batch: Any) -> bool:
        """Whether ``batch`` is laid out this way."""
        raise NotImplementedError

    def size(self, batch: Any) -> int:
        """The samples ``batch`` holds."""
        raise NotImplementedError

    def take(self, batch: Any, start: int, stop: int) -> Any:
        """Samples ``start`` to ``stop`` (excluded) of ``batch``, as a batch."""
        raise NotImplementedError

    def join(self, parts: Sequence[Any]) -> Any:
        """The samples of ``parts``, in order, as one batch."""
        raise NotImplementedError

    def share(self, part: Any) -> float | Tensor:
        """What ``part``'s mean loss weighs in the mean loss over the batches it was cut
        from (weights are these over their sum): its samples by default; a count may be a
        0-dim tensor where the part is, so that no step reads it on the host."""
        return float(self.size(part))

    def widest_first(self, batch: Any) -> Any:
        """``batch`` with the samples that cost most in a micro-batch first, so that the
        micro-batches measured of it hold the widest the batch can (a model that pads a
        micro-batch to its largest sample); as it is by default."""
        return batch


_ADDED: list[BatchLayout] = []


def add_batch_layout(layout: BatchLayout) -> None:
    """Make batches ``layout`` recognises count, cut and grow its way in this process
    (before the layouts autotune knows)."""
    if not isinstance(layout, BatchLayout):
        raise BatchError(
            f"add_batch_layout() takes an autotune.BatchLayout, got {type(layout).__name__}; "
            "subclass it with recognises, size, take and join."
        )
    if layout not in _ADDED:
        _ADDED.insert(0, layout)


def layout_of(batch: Any) -> BatchLayout | None:
    """The layout of ``batch``; ``None``: rows of dimension 0."""
    for layout in (*_ADDED, *_KNOWN):
        if layout.recognises(batch):
            return layout
    return None


def layouts_of_model(model: torch.nn.Module) -> None:
    """Add the layouts a model's batches take that only its config can say: a
    vision-language model's image token and patch merging (Qwen2-VL's ``image_token_id``
    and ``spatial_merge_size``)."""
    config = getattr(model, "config", None)
    token = getattr(config, "image_token_id", None)
    vision = getattr(config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    if isinstance(token, int) and isinstance(merge, int):
        add_batch_layout(ImagePatches(token, merge))


class PackedSequences(BatchLayout):
    """Padding-free packing: one row of sequences end to end (``input_ids`` and
    ``position_ids`` of shape ``(1, tokens)``, the positions starting again at 0 where a
    sequence starts), with, where the collator made them, ``cu_seq_lens_q/k``,
    ``max_length_q/k`` and ``seq_idx``. A sample is a sequence; a part's loss weighs its
    label tokens (a causal LM's loss over a packed row is the mean over its tokens, the
    first token of each sequence masked with -100)."""

    def recognises(self, batch: Any) -> bool:
        if not isinstance(batch, Mapping):
            return False
        ids, positions = batch.get("input_ids"), batch.get("position_ids")
        return (
            isinstance(ids, Tensor)
            and isinstance(positions, Tensor)
            and ids.ndim == 2
            and ids.shape[0] == 1
            and positions.shape == ids.shape
            and int((positions[0] == 0).sum()) > 1
        )

    def size(self, batch: Any) -> int:
        return len(_starts(batch))

    def take(self, batch: Any, start: int, stop: int) -> Any:
        starts = _starts(batch)
        tokens = batch["input_ids"].shape[1]
        ends = [*starts[1:], tokens]
        low, high = starts[start], ends[stop - 1]
        bounds = [s - low for s in starts[start:stop]] + [high - low]
        out = {}
        for key, value in batch.items():
            if _per_token(value, tokens):
                value = value[:, low:high]
                out[key] = value - start if key == "seq_idx" else value
            else:
                out[key] = _along(key, value, bounds)
        return type(batch)(out) if type(batch) is not dict else out

    def join(self, parts: Sequence[Any]) -> Any:
        first = parts[0]
        out: dict[str, Any] = {}
        bounds, offset, sequences = [0], 0, [0]
        for part in parts:
            starts = _starts(part)
            tokens = part["input_ids"].shape[1]
            bounds += [offset + s for s in starts[1:]] + [offset + tokens]
            offset += tokens
            sequences.append(sequences[-1] + len(starts))
        for key, value in first.items():
            if _per_token(value, first["input_ids"].shape[1]):
                # seq_idx numbers the sequences: each part's from where the last one ended
                shift = sequences if key == "seq_idx" else [0] * len(sequences)
                pieces = [p[key] + k for p, k in zip(parts, shift, strict=False)]
                out[key] = torch.cat(pieces, dim=1)
            else:
                out[key] = _along(key, value, bounds)
        return type(first)(out) if type(first) is not dict else out

    def share(self, part: Any) -> float | Tensor:
        labels = part.get("labels")
        if not isinstance(labels, Tensor):
            return float(part["input_ids"].shape[1])
        counted = (labels[:, 1:] != -100).sum()
        return float(counted) if on_host(labels) else counted  # no device waits


def _starts(batch: Any) -> list[int]:
    """Where each sequence of a packed row starts."""
    return [int(i) for i in (batch["position_ids"][0] == 0).nonzero().flatten()]


def _per_token(value: Any, tokens: int) -> bool:
    return isinstance(value, Tensor) and value.ndim >= 2 and value.shape[:2] == (1, tokens)


def _along(key: str, value: Any, bounds: list[int]) -> Any:
    """A packed batch's value that is not per token, for sequences ending at ``bounds``."""
    if key.startswith("cu_seq_lens") and isinstance(value, Tensor):
        return torch.tensor(bounds, dtype=value.dtype, device=value.device)
    if key.startswith("max_length"):
        return max(b - a for a, b in itertools.pairwise(bounds))
    if isinstance(value, Tensor) and value.ndim >= 1:
        raise BatchError(
            f"batch[{key!r}] of shape {tuple(value.shape)} in a packed batch is neither per "
            "token nor a known per-sequence value: autotune cannot cut it into sequences; "
            "describe the batch with a layout of your own (autotune.add_batch_layout)."
        )
    return value


class ImagePatches(BatchLayout):
    """A vision-language batch: rows of ``input_ids`` (each sample's text, its images as
    ``image_token`` runs), every image's patches in ``pixel_values`` one after another, and
    ``image_grid_thw``, each image's (frames, height, width) in patches; an image holds
    ``t * h * w`` patches and ``t * h * w / merge**2`` image tokens (Qwen2-VL's layout).

    Args:
        image_token: The id of the image token in ``input_ids``.
        merge: Patches merged per side into one token (Qwen2-VL's ``spatial_merge_size``).
    """

    def __init__(self, image_token: int, merge: int) -> None:
        self.image_token = image_token
        self.merge = merge

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImagePatches) and (other.image_token, other.merge) == (
            self.image_token,
            self.merge,
        )

    def __hash__(self) -> int:
        return hash((self.image_token, self.merge))

    def recognises(self, batch: Any) -> bool:
        keys = ("input_ids", "pixel_values", "image_grid_thw")
        return isinstance(batch, Mapping) and all(isinstance(batch.get(k), Tensor) for k in keys)

    def size(self, batch: Any) -> int:
        return int(batch["input_ids"].shape[0])

    def take(self, batch: Any, start: int, stop: int) -> Any:
        first, last = self._images(batch, start, stop)
        patches = batch["image_grid_thw"].prod(dim=1)
        low, high = int(patches[:first].sum()), int(patches[:last].sum())
        rows = batch["input_ids"].shape[0]
        out = {}
        for key, value in batch.items():
            if key == "pixel_values":
                out[key] = value[low:high]
            elif key == "image_grid_thw":
                out[key] = value[first:last]
            elif isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == rows:
                out[key] = value[start:stop]
            elif isinstance(value, Tensor) and value.ndim >= 2 and value.shape[1] == rows:
                out[key] = value[:, start:stop]  # Qwen2-VL's 3-D rope positions: (3, rows, len)
            else:
                out[key] = value
        return type(batch)(out) if type(batch) is not dict else out

    def join(self, parts: Sequence[Any]) -> Any:
        first = parts[0]
        rows = first["input_ids"].shape[0]
        out = {}
        for key, value in first.items():
            if key in ("pixel_values", "image_grid_thw") or (
                isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == rows
            ):
                out[key] = torch.cat([p[key] for p in parts])
            elif isinstance(value, Tensor) and value.ndim >= 2 and value.shape[1] == rows:
                out[key] = torch.cat([p[key] for p in parts], dim=1)
            else:
                out[key] = value
        return type(first)(out) if type(first) is not dict else out

    def _images(self, batch: Any, start: int, stop: int) -> tuple[int, int]:
        """The images of samples ``start`` to ``stop``: the first and the one past the last."""
        per_image = (batch["image_grid_thw"].prod(dim=1) // self.merge**2).tolist()
        tokens = (batch["input_ids"] == self.image_token).sum(dim=1).tolist()
        bounds, image = [0], 0
        for n in tokens:  # each row's images: its image tokens, image by image
            while n > 0 and image < len(per_image):
                n -= per_image[image]
                image += 1
            if n != 0:
                raise BatchError(
                    "the image tokens of a row of input_ids do not add up to whole images of "
                    "image_grid_thw: autotune cannot cut this batch into samples; describe it "
                    "with a layout of your own (autotune.add_batch_layout)."
                )
            bounds.append(image)
        return bounds[start], bounds[stop]


class SampleLists(BatchLayout):
    """A batch whose parts are lists with an entry per sample: torchvision's detection
    models' ``(images, targets)``, a list of image tensors of any sizes and a list of
    target dicts (``boxes``, ``labels``, ``masks``). Every list at the top of the batch (a
    tuple, list or Mapping) holds the same number of entries; what is not a list passes
    whole into every part. Recognised where a list holds records (dicts), or where its
    tensors do not share a first dimension (images of different sizes): a list of tensors
    that share one is read as rows, as before. Memory grows with the samples taken, each
    its own size (a detection model batches its images padded to the largest).
    """

    pads = True

    def recognises(self, batch: Any) -> bool:
        lists = _lists(batch)
        if not lists or len({len(v) for v in lists}) != 1 or not lists[0]:
            return False
        if _loose(batch):  # a tensor with rows beside the lists: rows, not samples
            return False
        entries = [e for v in lists for e in v]
        if any(isinstance(e, Mapping) for e in entries):
            return True
        firsts = {t.shape[0] for e in entries for t in _tensors(e) if t.ndim >= 1}
        return len(firsts) > 1

    def size(self, batch: Any) -> int:
        return len(_lists(batch)[0])

    def take(self, batch: Any, start: int, stop: int) -> Any:
        return _each_list(batch, lambda v: v[start:stop])

    def join(self, parts: Sequence[Any]) -> Any:
        lists = [_lists(p) for p in parts]
        joined = iter([[e for part in pieces for e in part] for pieces in zip(*lists, strict=True)])
        return _each_list(parts[0], lambda v: next(joined))

    def widest_first(self, batch: Any) -> Any:
        """The samples that stretch a padded micro-batch furthest first: the most upright
        and the flattest (a detection model resizes each image to a side, then pads the
        micro-batch to the tallest and the widest image it holds: these two reach the
        padded size of the whole batch), then the tallest and the widest (a model that only
        pads), then the rest by size. Height and width are the last two dimensions of a
        sample's largest tensor."""
        extents = [_extent(entries) for entries in zip(*_lists(batch), strict=True)]
        order = list(range(len(extents)))
        ranks: list[Callable[[tuple[int, int]], float]] = [
            lambda e: e[0] / e[1],
            lambda e: e[1] / e[0],
            lambda e: e[0],
            lambda e: e[1],
        ]
        first = [max(order, key=lambda i: rank(extents[i])) for rank in ranks]
        rest = sorted(order, key=lambda i: -extents[i][0] * extents[i][1])
        ranked = list(dict.fromkeys([*first, *rest]))
        if ranked == order:
            return batch
        return _each_list(batch, lambda v: [v[i] for i in ranked])


def on_host(t: Tensor) -> bool:
    """Whether ``t`` holds real values in host memory (not a fake tensor, as a traced plan
    makes, whose values cannot be read)."""
    return t.device.type == "cpu" and not is_fake(t)


def _extent(entries: Sequence[Any]) -> tuple[int, int]:
    """A sample's height and width: the last two dimensions of its largest tensor (a
    length, and 1, where it has one dimension)."""
    tensors = [t for e in entries for t in _tensors(e) if t.ndim >= 1]
    if not tensors:
        return 1, 1
    shape = [max(int(n), 1) for n in max(tensors, key=lambda t: t.numel()).shape]
    return (shape[-2], shape[-1]) if len(shape) >= 2 else (shape[0], 1)


def _values(batch: Any) -> list[Any]:
    """The parts at the top of a tuple, list or Mapping batch (none of anything else)."""
    if isinstance(batch, Mapping):
        return list(batch.values())
    return list(batch) if isinstance(batch, (tuple, list)) else []


def _lists(batch: Any) -> list[list[Any]]:
    """The lists at the top of ``batch``, in order."""
    return [v for v in _values(batch) if type(v) is list]


def _loose(batch: Any) -> bool:
    """Whether a tensor with a dimension sits in ``batch`` outside its lists (at the top,
    or in a tuple or Mapping there): rows, beside the lists."""
    return any(type(v) is not list and _holds_rows(v) for v in _values(batch))


def _holds_rows(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.ndim >= 1
    return any(_holds_rows(v) for v in _values(value))


def _tensors(entry: Any) -> list[Tensor]:
    """The tensors of one entry of a list (a tensor, or a tuple or Mapping of them)."""
    if isinstance(entry, Tensor):
        return [entry]
    return [v for v in _values(entry) if isinstance(v, Tensor)]


def _each_list(batch: Any, fn: Any) -> Any:
    """``batch`` with ``fn`` applied to each list at its top, in order."""

    def one(v: Any) -> Any:
        return fn(v) if type(v) is list else v

    kind: Any = type(batch)
    if isinstance(batch, Mapping):
        out = {k: one(v) for k, v in batch.items()}
        return kind(out) if kind is not dict else out
    items = [one(v) for v in batch]
    return kind(*items) if hasattr(kind, "_fields") else kind(items)


_KNOWN: tuple[BatchLayout, ...] = (PackedSequences(), SampleLists())
"""The layouts recognised in any batch (those that need the model's config are added by
:func:`layouts_of_model`)."""
