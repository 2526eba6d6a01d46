"""Batches that are not rows: padding-free packed sequences and a vision-language batch of
image patches are counted in samples, cut into micro-batches and grown, tuned, verified and
trained, each micro-batch's loss weighed so that the step's loss is the whole batch's."""

from __future__ import annotations

import copy

import pytest
import torch

import autotune
from autotune import SearchSpace
from autotune.errors import BatchError
from autotune.train._batch import batch_size, resize, shares, split, widest_first

transformers = pytest.importorskip("transformers")

LENGTHS = (7, 12, 5, 9, 11, 6)


def packed(lengths: tuple[int, ...] = LENGTHS, **extra: bool) -> dict[str, object]:
    """Sequences end to end in one row, as padding-free packing makes them: positions start
    again at 0, each sequence's first label is -100 (no token predicts across a border)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 128, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    labels[positions == 0] = -100
    batch: dict[str, object] = {"input_ids": ids, "position_ids": positions, "labels": labels}
    if extra.get("flash"):  # what TRL's collator adds for FlashAttention's varlen kernels
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        batch |= {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds}
        batch |= {"max_length_q": max(lengths), "max_length_k": max(lengths)}
        batch["seq_idx"] = torch.cat(
            [torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]
        ).unsqueeze(0)
    return batch


def test_a_packed_row_is_cut_and_grown_by_sequence() -> None:
    batch = packed(flash=True)
    assert batch_size(batch) == 6
    parts = split(batch, 4)
    assert [p["input_ids"].shape[1] for p in parts] == [33, 17]
    second = packed(LENGTHS[4:], flash=True)  # the second part's sequences, packed alone
    assert second.keys() == parts[1].keys()
    assert torch.equal(parts[1]["input_ids"], batch["input_ids"][:, 33:])
    for key in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"):
        assert torch.equal(torch.as_tensor(parts[1][key]), torch.as_tensor(second[key])), key
    grown = resize(batch, 9)  # the sequences again, cyclically
    assert batch_size(grown) == 9
    assert torch.equal(
        grown["cu_seq_lens_q"], packed(LENGTHS + LENGTHS[:3], flash=True)["cu_seq_lens_q"]
    )
    assert grown["seq_idx"][0, -1] == 8 and grown["max_length_q"] == 12
    # Each part weighs its label tokens: the whole row's loss is a mean over tokens.
    assert shares(batch, parts) == pytest.approx([(33 - 4) / 44, (17 - 2) / 44])
    # A part of one sequence is a plain row, and still weighs its label tokens.
    assert shares(batch, split(batch, 1)) == pytest.approx([(n - 1) / 44 for n in LENGTHS])


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_packed_batch_tunes_and_trains_with_the_whole_batchs_loss() -> None:
    model, batch = llama(), packed()
    # Without a key/value cache (prepare() turns it off) transformers attends within each
    # sequence of a packed row, as if each were alone.
    whole = model(**batch, use_cache=False).loss
    alone = [model(**part, use_cache=False).loss for part in split(batch, 1)]
    tokens = [n - 1 for n in LENGTHS]  # each sequence's first label is -100
    torch.testing.assert_close(whole, sum(a * n for a, n in zip(alone, tokens, strict=True)) / 44)
    space = SearchSpace(precisions=("fp32",), micro_batch_sizes=(2,))
    result = autotune.autotune(model, batch, 0.25, global_batch_size=6, space=space, device="cpu")
    assert result.measured is not None and result.config.grad_accum_steps == 3
    with autotune.prepare(copy.deepcopy(model), result, device="cpu") as runner:
        torch.testing.assert_close(runner.step(batch), whole.detach())


def qwen2_vl() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        text_config={
            "vocab_size": 160, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "eos_token_id": 1, "bos_token_id": 0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
        image_token_id=151, video_token_id=152, vision_start_token_id=150,
        vision_end_token_id=153,
    )  # fmt: skip
    return transformers.Qwen2VLForConditionalGeneration(config)


def images_batch() -> dict[str, torch.Tensor]:
    """Two samples with an image each, of 16 and 32 patches (4 and 8 image tokens): the
    processor's layout, every image's patches in one tensor."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for tokens in (4, 8):
        ids = torch.randint(2, 140, (24,), generator=g)
        ids[2], ids[3 : 3 + tokens], ids[3 + tokens] = 150, 151, 153
        rows.append(ids)
    ids = torch.stack(rows)
    return {
        "input_ids": ids,
        "labels": ids,
        "mm_token_type_ids": (ids == 151).long(),
        "pixel_values": torch.randn(48, 3 * 14 * 14 * 2, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 8]]),
    }


def test_a_vision_language_batch_tunes_and_trains_cut_by_image() -> None:
    model, batch = qwen2_vl(), images_batch()
    with pytest.raises(BatchError, match="has 2 rows but batch\\['pixel_values'\\] has 48"):
        batch_size({k: v for k, v in batch.items() if k != "image_grid_thw"})
    whole = model(**batch).loss
    space = SearchSpace(precisions=("fp32",), micro_batch_sizes=(1,))
    result = autotune.autotune(model, batch, 0.25, global_batch_size=2, space=space, device="cpu")
    assert result.measured is not None and result.config.grad_accum_steps == 2
    second = split(batch, 1)[1]
    assert second["pixel_values"].shape[0] == 32 and second["image_grid_thw"].tolist() == [
        [1, 4, 8]
    ]
    with autotune.prepare(copy.deepcopy(model), result, device="cpu") as runner:
        torch.testing.assert_close(runner.step(batch), whole.detach())


def faster_rcnn() -> torch.nn.Module:
    """torchvision's Faster R-CNN (its transform, region proposals and box heads) on a
    two-layer backbone, small enough for a test's steps."""
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(0)
    backbone = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
    )  # fmt: skip
    backbone.out_channels = 16
    return FasterRCNN(
        backbone, min_size=48, max_size=80,
        rpn_anchor_generator=AnchorGenerator(((8, 16),), ((0.5, 1.0, 2.0),)),
        rpn_pre_nms_top_n_train=64, rpn_post_nms_top_n_train=32,
        box_roi_pool=MultiScaleRoIAlign(["0"], 7, 2), box_head=TwoMLPHead(16 * 49, 64),
        box_predictor=FastRCNNPredictor(64, 3), box_batch_size_per_image=16,
    )  # fmt: skip


def detection_batch() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """torchvision's ``(images, targets)``: four images of different sizes, each with its
    boxes and labels."""
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, h, w, generator=g) for h, w in ((60, 80), (72, 56), (64, 64), (50, 90))]
    targets = [
        {"boxes": torch.tensor([[4.0, 6.0, 30.0, 40.0]] * n), "labels": torch.ones(n, dtype=torch.int64)}
        for n in (1, 2, 3, 4)
    ]  # fmt: skip
    return images, targets


def test_a_detection_batch_is_cut_by_sample() -> None:
    images, targets = batch = detection_batch()
    assert batch_size(batch) == 4  # not the images' 3 channels, nor a target's boxes
    second = split(batch, 3)[1]
    assert second[0][0] is images[3] and second[1][0] is targets[3]
    grown = resize(batch, 6)  # new tensors, as a loader's batch holds
    assert torch.equal(grown[0][5], images[1]) and grown[0][5] is not images[1]
    # Lists of tensors that share their first dimension are rows, as before.
    assert batch_size(([torch.ones(5, 2), torch.ones(5, 3)], [torch.ones(5), torch.ones(5)])) == 5
    # The most upright and the flattest image first, then the tallest and the widest.
    ordered = widest_first(batch)
    assert [tuple(i.shape[1:]) for i in ordered[0]] == [(72, 56), (50, 90), (60, 80), (64, 64)]
    assert ordered[1][0] is targets[1] and widest_first(ordered) is ordered


def retinanet() -> torch.nn.Module:
    """torchvision's RetinaNet (its transform, anchors and focal loss) on a two-layer
    backbone."""
    from torchvision.models.detection import RetinaNet
    from torchvision.models.detection.anchor_utils import AnchorGenerator

    torch.manual_seed(0)
    backbone = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
    )  # fmt: skip
    backbone.out_channels = 16
    anchors = AnchorGenerator(((8, 16),), ((0.5, 1.0, 2.0),))
    return RetinaNet(backbone, 3, min_size=48, max_size=80, anchor_generator=anchors)


def varied_images(n: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """``n`` images upright, flat and square, of 40 to 96 pixels a side, with boxes."""
    g = torch.Generator().manual_seed(1)
    images, targets = [], []
    for _ in range(n):
        h, w = (int(x) for x in torch.randint(40, 97, (2,), generator=g))
        images.append(torch.rand(3, h, w, generator=g))
        k = int(torch.randint(1, 4, (1,), generator=g))
        corner = torch.rand(k, 2, generator=g) * torch.tensor([w / 2, h / 2])
        boxes = torch.cat([corner, corner + 8 + torch.rand(k, 2, generator=g) * 16], 1)
        targets.append({"boxes": boxes, "labels": torch.randint(1, 3, (k,), generator=g)})
    return images, targets


@pytest.mark.parametrize("build", [retinanet, faster_rcnn], ids=["retinanet", "faster-rcnn"])
def test_a_detection_model_padding_its_micro_batches_is_verified_as_predicted(build) -> None:
    """A detection model pads each micro-batch to its largest image: memory is not linear
    in the micro-batch of a sample's first images. Measured and verified on micro-batches
    of the widest images the sample holds (the most upright and the flattest first), the
    prediction bounds every micro-batch of it: at a budget that binds, each verified
    config's peak within 2% of its prediction (a micro-batch of one image, which pads
    nothing, under it), none over the budget."""
    model, batch = build(), varied_images(8)

    def loss(output: dict[str, torch.Tensor], batch: object) -> torch.Tensor:
        return sum(output.values())  # type: ignore[return-value]

    common = {"device": "cpu", "loss_fn": loss}
    whole = autotune.TrainConfig(micro_batch_size=8, optimizer="sgd")
    peak, _ = autotune.estimate(model, batch, whole, **common)
    space = SearchSpace(precisions=("fp32",), optimizers=("sgd",))
    result = autotune.autotune(
        model, batch, 0.8 * peak / 2**30, global_batch_size=8, space=space, **common
    )
    assert result.config.micro_batch_size < 8  # the budget binds
    verified = [t for t in result.trials if t.measured is not None]
    assert len(verified) >= 2
    for t in verified:
        measured, predicted = t.measured.peak_bytes, t.predicted.peak_bytes
        assert measured <= min(result.budget_bytes, 1.02 * predicted), t
        if t.config.micro_batch_size > 1:
            assert measured == pytest.approx(predicted, rel=0.02), t
    # It trains as tuned, cut by sample: the model given each micro-batch's lists whole.
    trained = copy.deepcopy(model)
    with autotune.prepare(trained, result, loss_fn=loss, device="cpu") as runner:
        assert torch.isfinite(runner.step(batch))
    moved = [
        not torch.equal(a, b) for a, b in zip(model.parameters(), trained.parameters(), strict=True)
    ]
    assert any(moved)
