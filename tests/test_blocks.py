"""Blocks (autotune.find_blocks): finding a model's repeated layers and checking named ones."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from autotune._blocks import find_blocks, resolve_blocks
from autotune.errors import BlockError

# --- small models of our own -------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer-style block: attention stand-in plus MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


class TinyGPT(nn.Module):
    """nanoGPT-shaped: embeddings, a ModuleList of blocks, a head tied to the embedding."""

    def __init__(self, n_layer: int = 3, dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(Block(dim) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


class Head(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)


class StackWithHeads(nn.Module):
    """A transformer stack next to a ModuleList of two tiny (non-leaf) heads."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(4))
        self.heads = nn.ModuleList([Head(dim), Head(dim)])


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convs with batch norm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.layer3 = nn.Sequential(BasicBlock(16, 32, 2), BasicBlock(32, 32))
        self.fc = nn.Linear(32, 10)


class Stage(nn.Module):
    """A vision stage: a downsampling conv, then a Sequential of residual layers."""

    def __init__(self, cin: int, cout: int, depth: int) -> None:
        super().__init__()
        self.downsample = nn.Conv2d(cin, cout, 2, 2)
        self.layers = nn.Sequential(*(BasicBlock(cout, cout) for _ in range(depth)))


class StagedNet(nn.Module):
    """HF ResNet-shaped: a ModuleList of stages, each holding a run of layers."""

    def __init__(self, depths: tuple[int, ...] = (1, 2, 3)) -> None:
        super().__init__()
        widths = [8, 8, 16, 32][: len(depths) + 1]
        self.stem = nn.Conv2d(3, 8, 3)
        self.stages = nn.ModuleList(
            Stage(cin, cout, d)
            for cin, cout, d in zip(widths[:-1], widths[1:], depths, strict=True)
        )


class MoEBlock(nn.Module):
    """A transformer layer whose MLP is a mixture of experts (a ModuleList of MLPs)."""

    def __init__(self, dim: int, n_experts: int, nested: bool = True) -> None:
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        router = nn.Linear(dim, n_experts, bias=False)
        experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(n_experts)
        )
        if nested:  # Hugging Face style: layer.mlp.gate, layer.mlp.experts
            self.mlp = nn.Module()
            self.mlp.gate, self.mlp.experts = router, experts
        else:  # the router and experts held by the layer itself
            self.gate, self.experts = router, experts


class NoRepeats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 2)


class Mixer(nn.Module):
    """A Mamba-style layer: another class than Block, stacked with it in hybrid models."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.out_proj = nn.Linear(2 * dim, dim)


class Projection(nn.Module):
    """A thin wrapper around one Linear, like Segformer's per-stage MLPs."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.proj = nn.Linear(cin, cout)
        self.act = nn.GELU()


class Resnets(nn.Module):
    """A diffusers-style U-Net block: resnets and attentions run interleaved."""

    def __init__(self, dim: int, attention: bool) -> None:
        super().__init__()
        if attention:
            self.attentions = nn.ModuleList(Block(dim) for _ in range(2))
        self.resnets = nn.ModuleList(Block(dim) for _ in range(2))


class TinyUNet(nn.Module):
    """Registers ``up_blocks`` before ``mid_block``, as diffusers does; the mid block runs first."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, dim, 3)
        self.down_blocks = nn.ModuleList([Resnets(dim, True), Resnets(dim, False)])
        self.up_blocks = nn.ModuleList()
        self.mid_block = Resnets(dim, True)
        self.up_blocks.extend([Resnets(dim, False), Resnets(dim, True)])
        self.conv_out = nn.Conv2d(dim, 3, 3)


def _layers(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i in range(n))


# --- find_blocks on our own models -------------------------------------------------------


def test_plain_sequential_gives_its_children_with_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_blocks(model) == ("0", "2", "4")


def test_sequential_of_consecutive_linears_is_a_run_of_leaves() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU())
    assert find_blocks(model) == ("0", "1", "2")


def test_resnet_gives_every_residual_block_across_stages() -> None:
    expected = tuple(f"layer{s}.{i}" for s in (1, 2, 3) for i in (0, 1))
    assert find_blocks(TinyResNet()) == expected


def test_gpt_with_tied_weights() -> None:
    model = TinyGPT(n_layer=3)
    assert model.lm_head.weight is model.wte.weight
    assert find_blocks(model) == ("h.0", "h.1", "h.2")


def test_small_heads_next_to_a_stack_are_not_blocks() -> None:
    assert find_blocks(StackWithHeads()) == tuple(f"layers.{i}" for i in range(4))


def test_runs_of_layers_win_over_runs_of_leaves() -> None:
    model = nn.Module()
    model.proj = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # larger than the stack
    model.layers = nn.ModuleList(Block(4) for _ in range(2))
    assert find_blocks(model) == ("layers.0", "layers.1")


def test_small_runs_are_kept_when_all_runs_are_small() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(100_000, 16)  # holds > 99% of the parameters
    model.layers = nn.ModuleList(Block(4) for _ in range(2))
    assert find_blocks(model) == ("layers.0", "layers.1")


def test_large_run_of_linears_beats_tiny_heads() -> None:
    # the 1% size cut comes before preferring runs of non-leaf modules
    model = nn.Module()
    model.mlp = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    model.heads = nn.ModuleList([Head(64), Head(64)])  # non-leaf, but < 1% of the parameters
    assert find_blocks(model) == ("mlp.0", "mlp.1", "mlp.2", "mlp.3")


def test_nested_runs_give_the_inner_layers() -> None:
    # a run of Sequentials of layers is a run of stages: its layers are the blocks
    # (before stages were opened this gave ("stages.0", "stages.1"))
    model = nn.Module()
    model.stages = nn.ModuleList(nn.Sequential(Block(8), Block(8)) for _ in range(2))
    assert find_blocks(model) == ("stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1")


def test_stages_give_their_layers_in_order_one_layer_stages_included() -> None:
    expected = ("stages.0.layers.0", *_layers("stages.1.layers", 2), *_layers("stages.2.layers", 3))
    assert find_blocks(StagedNet((1, 2, 3))) == expected


def test_stage_with_a_minority_layer_of_another_class_is_opened() -> None:
    # LeViT-style: a subsampling layer of another class among the stage's layers
    model = nn.Module()
    model.stages = nn.ModuleList(
        nn.ModuleList([Block(8), Block(8), Head(8), Block(8)]) for _ in range(2)
    )
    expected = tuple(f"stages.{s}.{i}" for s in (0, 1) for i in range(4))
    assert find_blocks(model) == expected


def test_wrapper_whose_stack_holds_under_half_its_parameters_stays_a_block() -> None:
    model = nn.Module()
    model.stages = nn.ModuleList(Stage(8, 8, 1) for _ in range(2))
    for stage in model.stages:
        stage.downsample = nn.Conv2d(8, 8, 7)  # 3 x the parameters of the stage's layer
    assert find_blocks(model) == ("stages.0", "stages.1")


def test_stages_are_opened_one_level_only() -> None:
    # each layer (a Stage) would pass for a stage itself, like HF ResNet's bottleneck with its
    # Sequential of three conv layers; only one level is opened
    model = nn.Module()
    model.stages = nn.ModuleList(nn.Sequential(Stage(8, 8, 2), Stage(8, 8, 2)) for _ in range(2))
    assert find_blocks(model) == ("stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1")


@pytest.mark.parametrize("nested", [True, False], ids=["mlp.experts", "experts"])
def test_mixture_of_experts_layers_stay_blocks(nested: bool) -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(MoEBlock(16, n_experts=4, nested=nested) for _ in range(3))
    assert find_blocks(model) == _layers("layers", 3)


def test_a_module_listed_twice_is_one_block() -> None:
    shared = Block(8)
    model = nn.Module()
    model.h = nn.ModuleList([Block(8), shared, shared, Block(8)])
    model.alias = shared  # reachable under a second name too
    assert find_blocks(model) == ("h.0", "h.1", "h.3")


def test_parameterless_children_break_runs() -> None:
    model = nn.Module()
    model.seq = nn.Sequential(nn.Dropout(), nn.Dropout(), Block(8), nn.Identity(), Block(8))
    assert find_blocks(model) == ("seq.2", "seq.4")


@pytest.mark.parametrize(
    "pattern",
    ["ABAB", "AAAB" * 3, "AAABAAABAA", "AABA" * 2],
    ids=["ABAB", "AAAB-AAAB-AAAB", "cut-short", "AABA-AABA"],
)
def test_classes_repeating_in_a_pattern_are_one_stack(pattern: str) -> None:
    # Jamba-style hybrids: Mamba (A) and attention (B) layers alternate in one ModuleList
    model = nn.Module()
    model.layers = nn.ModuleList(Block(8) if c == "B" else Mixer(8) for c in pattern)
    assert find_blocks(model) == _layers("layers", len(pattern))


def test_a_class_holding_most_layers_takes_the_others_between() -> None:
    # Zamba2-style: hybrid layers placed irregularly among Mamba layers
    pattern = "AABABAAABA"
    model = nn.Module()
    model.layers = nn.ModuleList(Block(8) if c == "B" else Mixer(8) for c in pattern)
    assert find_blocks(model) == _layers("layers", len(pattern))


def test_other_layers_around_a_stack_are_left_out_or_runs_of_their_own() -> None:
    # MobileNet-style: a stem and a last layer of another class around the stack
    model = nn.Module()
    model.features = nn.Sequential(Mixer(8), Block(8), Block(8), Block(8), Mixer(8))
    assert find_blocks(model) == _layers("features", 5)[1:4]
    # MobileViT-style: a run of one class before a stack of another: two runs
    model.features = nn.Sequential(Mixer(8), Mixer(8), Block(8), Block(8), Block(8))
    assert find_blocks(model) == _layers("features", 5)


def test_two_layers_of_differing_classes_are_the_blocks() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(16, 8)
    model.layers = nn.ModuleList([Mixer(8), Block(8)])
    assert find_blocks(model) == ("layers.0", "layers.1")


def test_one_layer_shared_by_every_depth_is_the_block() -> None:
    # ALBERT-style: one layer group, called once per layer; no run anywhere
    model = nn.Module()
    model.embed = nn.Embedding(16, 8)
    model.groups = nn.ModuleList([nn.ModuleList([Block(8)])])
    assert find_blocks(model) == ("groups.0.0",)  # the list is never called: its layer


def test_projections_are_not_layers() -> None:
    # Segformer-style: one projection per stage (a thin wrapper around an nn.Linear); their
    # widths may chain by chance, as here, and they are still no stack
    model = nn.Module()
    model.layers = nn.ModuleList(Block(8) for _ in range(2))
    model.heads = nn.ModuleList([Projection(8, 32), Projection(32, 32), Projection(32, 32)])
    assert find_blocks(model) == ("layers.0", "layers.1")
    # wav2vec2-style: thin wrappers around convs are conv layers
    model.convs = nn.ModuleList(nn.Sequential(nn.Conv1d(8, 8, 3), nn.GELU()) for _ in range(3))
    assert find_blocks(model) == (*_layers("layers", 2), *_layers("convs", 3))


def test_u_net_blocks_come_down_mid_up_in_the_order_they_run() -> None:
    model = TinyUNet()
    assert [name for name, _ in model.named_children()][1:4] == [
        "down_blocks",
        "up_blocks",
        "mid_block",
    ]
    expected = ("down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1")
    assert find_blocks(model) == expected
    named = ["up_blocks.1.resnets.0", "mid_block", "down_blocks.0.attentions.1"]
    assert resolve_blocks(model, named) == tuple(reversed(named))


def test_no_repeated_layers_is_a_helpful_error() -> None:
    with pytest.raises(BlockError) as info:
        find_blocks(NoRepeats())
    message = str(info.value)
    assert "no repeated layers" in message
    assert "SearchSpace(blocks=[...])" in message
    assert "conv, fc" in message
    assert "SearchSpace(checkpointing=False)" in message


class Pooled(NoRepeats):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean(dim=(2, 3))).pow(2).mean()


def test_the_space_the_error_suggests_tunes_such_a_model() -> None:
    import autotune

    model, batch = Pooled(), torch.randn(4, 3, 8, 8)
    with pytest.raises(BlockError, match=r"SearchSpace\(checkpointing=False\)"):
        autotune.autotune(model, batch, 0.01, device="cpu", global_batch_size=8)
    space = autotune.SearchSpace(checkpointing=False)
    result = autotune.autotune(model, batch, 0.01, device="cpu", global_batch_size=8, space=space)
    assert result.config.checkpoint == () and result.measured.peak_bytes <= result.budget_bytes


def test_find_blocks_leaves_the_model_as_it_was() -> None:
    model = TinyGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    find_blocks(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# --- find_blocks on Hugging Face models (small configs, no downloads) -----------------------


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return transformers.LlamaForCausalLM(config)


def _bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return transformers.BertForMaskedLM(config)


def _vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    return transformers.ViTForImageClassification(config)


def _t5() -> nn.Module:
    import transformers

    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=64
    )
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> nn.Module:
    import transformers

    config = transformers.BartConfig(
        encoder_layers=2,
        decoder_layers=2,
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return transformers.BartForConditionalGeneration(config)


def _whisper() -> nn.Module:
    import transformers

    config = transformers.WhisperConfig(
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=64,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config)


def _clip() -> nn.Module:
    import transformers

    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = transformers.CLIPConfig(
        text_config={
            **tower,
            "num_attention_heads": 2,
            "vocab_size": 64,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
            "max_position_embeddings": 16,
        },
        vision_config={**tower, "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
        projection_dim=16,
    )
    return transformers.CLIPModel(config)


def _mixtral() -> nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(config)


def _resnet() -> nn.Module:
    import transformers

    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2], num_labels=3
    )
    return transformers.ResNetForImageClassification(config)


def _convnext() -> nn.Module:
    import transformers

    config = transformers.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 2], num_labels=3
    )
    return transformers.ConvNextForImageClassification(config)


def _swin() -> nn.Module:
    import transformers

    config = transformers.SwinConfig(
        image_size=16,
        patch_size=4,
        embed_dim=8,
        depths=[2, 1],
        num_heads=[1, 2],
        window_size=2,
        num_labels=3,
    )
    return transformers.SwinForImageClassification(config)


_TINY_LM = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}


def _albert() -> nn.Module:
    import transformers

    config = transformers.AlbertConfig(
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=37,
        num_hidden_layers=4,
        embedding_size=16,
        vocab_size=99,
    )
    return transformers.AlbertForMaskedLM(config)


def _jamba(layers: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config = transformers.JambaConfig(
            **_TINY_LM,
            num_hidden_layers=layers,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=4,
            mamba_dt_rank=4,
        )
        return transformers.JambaForCausalLM(config)

    return build


def _zamba() -> nn.Module:
    import transformers

    config = transformers.ZambaConfig(
        **_TINY_LM,
        num_hidden_layers=6,  # Mamba, Mamba, hybrid, Mamba, hybrid, Mamba: no period
        attention_hidden_size=64,
        attention_head_dim=32,
        n_mamba_heads=2,
        attn_layer_period=3,
        attn_layer_offset=1,
        mamba_d_state=4,
        mamba_dt_rank=4,
    )
    return transformers.ZambaForCausalLM(config)


def _zamba2() -> nn.Module:
    import transformers

    config = transformers.Zamba2Config(
        **_TINY_LM,
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=4,
        n_mamba_heads=2,
        mamba_ngroups=1,
        num_mem_blocks=1,
        adapter_rank=4,
        chunk_size=8,
    )
    return transformers.Zamba2ForCausalLM(config)


def _segformer() -> nn.Module:
    import transformers

    config = transformers.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 2],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        patch_sizes=[3, 3],
        strides=[2, 2],
        decoder_hidden_size=16,  # projections 8 -> 16 and 16 -> 16, as if they were a stack
        num_labels=3,
    )
    return transformers.SegformerForSemanticSegmentation(config)


def _hybrid(name: str, layers: int, **kwargs: object) -> Callable[[], nn.Module]:
    """A hybrid (Mamba or linear attention, and attention) decoder of ``layers`` layers."""

    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, f"{name}Config")(
            **_TINY_LM, num_hidden_layers=layers, **kwargs
        )
        return getattr(transformers, f"{name}ForCausalLM")(config)

    return build


_MAMBA2 = {"mamba_n_heads": 2, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 4}


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (_gpt2, _layers("transformer.h", 2)),
        (_llama, _layers("model.layers", 3)),
        (_bert, _layers("bert.encoder.layer", 2)),
        (_vit, _layers("vit.layers", 2)),  # transformers 5 flattened ViT's encoder
        (_t5, _layers("encoder.block", 2) + _layers("decoder.block", 2)),
        (_bart, _layers("model.encoder.layers", 2) + _layers("model.decoder.layers", 2)),
        (_whisper, _layers("model.encoder.layers", 2) + _layers("model.decoder.layers", 2)),
        (  # registered text tower first, but runs the vision tower first
            _clip,
            _layers("vision_model.encoder.layers", 2) + _layers("text_model.encoder.layers", 2),
        ),
        (_mixtral, _layers("model.layers", 2)),  # each MoE layer is one block
        # staged vision models: the layers of every stage, a one-layer stage included
        (
            _resnet,
            ("resnet.encoder.stages.0.layers.0", *_layers("resnet.encoder.stages.1.layers", 2)),
        ),
        (
            _convnext,
            ("convnext.encoder.stages.0.layers.0", *_layers("convnext.encoder.stages.1.layers", 2)),
        ),
        (_swin, (*_layers("swin.encoder.layers.0.blocks", 2), "swin.encoder.layers.1.blocks.0")),
        # one layer group, shared: called once per layer (no run of layers anywhere)
        (_albert, ("albert.encoder.albert_layer_groups.0",)),
        # hybrids: Mamba and attention layers of differing classes in one ModuleList
        (_jamba(4), _layers("model.layers", 4)),
        (_jamba(2), _layers("model.layers", 2)),
        (_zamba, _layers("model.layers", 6)),
        (_zamba2, _layers("model.layers", 4)),  # not the adapters inside its hybrid layers
        # hybrids whose layers are of one class
        (
            _hybrid("FalconH1", 3, **{**_MAMBA2, "mamba_d_ssm": 32, "mamba_d_head": 16}),
            _layers("model.layers", 3),
        ),
        (_hybrid("Bamba", 4, attn_layer_indices=[1, 3], **_MAMBA2), _layers("model.layers", 4)),
        (
            _hybrid(
                "GraniteMoeHybrid",
                4,
                layer_types=["mamba", "attention"] * 2,
                num_local_experts=2,
                num_experts_per_tok=1,
                shared_intermediate_size=32,
                **_MAMBA2,
            ),
            _layers("model.layers", 4),
        ),
        (
            _hybrid("Lfm2", 4, layer_types=["conv", "full_attention"] * 2),
            _layers("model.layers", 4),
        ),
        (
            _hybrid(
                "Qwen3Next",
                4,
                head_dim=16,
                layer_types=["linear_attention"] * 3 + ["full_attention"],
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_num_key_heads=2,
                linear_num_value_heads=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
                num_experts=2,
                num_experts_per_tok=1,
            ),
            _layers("model.layers", 4),
        ),
        # the encoder's layers, not the decode head's per-stage projections
        (
            _segformer,
            ("segformer.stages.0.blocks.0", *_layers("segformer.stages.1.blocks", 2)),
        ),
    ],
    ids=[
        "gpt2",
        "llama",
        "bert",
        "vit",
        "t5",
        "bart",
        "whisper",
        "clip",
        "mixtral",
        "resnet",
        "convnext",
        "swin",
        "albert",
        "jamba",
        "jamba-2-layers",
        "zamba",
        "zamba2",
        "falcon-h1",
        "bamba",
        "granite-moe-hybrid",
        "lfm2",
        "qwen3-next",
        "segformer",
    ],
)
def test_hugging_face_models(build: Callable[[], nn.Module], expected: tuple[str, ...]) -> None:
    pytest.importorskip("transformers")
    model = build()
    names = dict(model.named_modules())
    assert all(name in names for name in expected)  # the names really exist
    assert find_blocks(model) == expected


def _unet() -> nn.Module:
    import diffusers

    return diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
        sample_size=16,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )


def _vae() -> nn.Module:
    import diffusers

    return diffusers.AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
    )


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        # diffusers registers mid_block after up_blocks; it runs between the two paths
        (_unet, ("down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1")),
        (
            _vae,
            (
                *_layers("encoder.down_blocks", 2),
                "encoder.mid_block",
                "decoder.mid_block",  # a decoder's path starts at its middle
                *_layers("decoder.up_blocks", 2),
            ),
        ),
    ],
    ids=["unet", "vae"],
)
def test_diffusers_u_nets_in_the_order_they_run(
    build: Callable[[], nn.Module], expected: tuple[str, ...]
) -> None:
    pytest.importorskip("diffusers")
    model = build()
    names = dict(model.named_modules())
    assert all(name in names for name in expected)
    assert find_blocks(model) == expected


# --- resolve_blocks -----------------------------------------------------------------------


def test_resolve_none_is_find_blocks() -> None:
    model = TinyGPT()
    assert resolve_blocks(model, None) == find_blocks(model)


def test_resolve_returns_named_blocks_in_model_order() -> None:
    model = TinyGPT(n_layer=3)
    assert resolve_blocks(model, ["h.2", "wte", "h.0.mlp"]) == ("wte", "h.0.mlp", "h.2")
    assert resolve_blocks(model, ()) == ()


def test_resolve_unknown_name_suggests_close_matches() -> None:
    with pytest.raises(BlockError, match=r"'h\.7'.*Did you mean.*'h\.0'"):
        resolve_blocks(TinyGPT(n_layer=2), ["h.1", "h.7"])


def test_resolve_rejects_nested_blocks() -> None:
    with pytest.raises(BlockError, match=r"'h\.0\.attn' lies inside block 'h\.0'"):
        resolve_blocks(TinyGPT(), ["h.0.attn", "h.1", "h.0"])


def test_resolve_rejects_duplicates() -> None:
    with pytest.raises(BlockError, match=r"more than once: h\.1"):
        resolve_blocks(TinyGPT(), ["h.1", "h.0", "h.1"])


def test_resolve_rejects_the_root_and_a_bare_string() -> None:
    with pytest.raises(BlockError, match="root"):
        resolve_blocks(TinyGPT(), [""])
    with pytest.raises(BlockError, match=r"\['h\.0'\]"):
        resolve_blocks(TinyGPT(), "h.0")


def test_a_layer_held_as_a_module_list_gives_its_called_parts() -> None:
    """``layers[i] = ModuleList([attention, feed-forward])``, called part by part: a list is
    never called, so checkpointing it would do nothing; its parts are the blocks."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.ModuleList([nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8))])
                for _ in range(2)
            )

    assert find_blocks(Pair()) == ("layers.0.0", "layers.0.1", "layers.1.0", "layers.1.1")
