"""The weight bytes a forward step reads (``asyncstep.models.weight_reads``),
counted by hand on tiny-llama (random weights, float32): a layer's packed
copy where the step is small enough for it, its dense weight above, the
input embedding's looked-up rows and not its table; two pipeline ranks
report together what one rank reports alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import asyncstep
from asyncstep.config import ModelConfig
from asyncstep.datatypes import ExpertReads, PackedReads, WeightReads
from asyncstep.models.dummy import SHAPES
from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncstep.models.model_loader import load_model
from asyncstep.models.registry import model_class
from asyncstep.models.weight_reads import weight_reads
from asyncstep.ops.cpu.quant import CpuQuantWeight
from asyncstep.ops.packed import PackedWeight

F32 = 4
# tiny-llama: vocab 512, hidden 64, intermediate 128, 4 layers, 4 heads and
# 2 KV heads of 16, the LM head tied to the embedding.
QKV = (4 + 2 + 2) * 16 * 64
O_PROJ = 64 * 64
GATE_UP = 2 * 128 * 64
DOWN = 64 * 128
LINEARS = 4 * (QKV + O_PROJ + GATE_UP + DOWN) * F32
NORMS = (4 * 2 * 64 + 64) * F32  # two a layer, and the final one
TABLE = 512 * 64 * F32  # the tied LM head reads it whole
ROW = 64 * F32  # one token's embedding row
# Q4 blocks: 16 rows x 32 inputs in 320 bytes (256 of codes, 16 + 16 float16 scales and offsets).
Q4_LINEARS = 4 * (8 * 2 + 4 * 2 + 16 * 2 + 4 * 4) * 320
INT8_HEAD = 512 * 64 + 512 * F32  # int8 codes, a float32 scale a row


def tiny_llama() -> torch.nn.Module:
    config = ModelConfig(
        model="tiny-llama",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        weight_packing="none",
    )
    return load_model(config).model


def test_a_dense_step_reads_every_weight_but_the_embedding_table() -> None:
    reads = weight_reads(tiny_llama())
    assert reads == WeightReads(dense_bytes=LINEARS + NORMS + TABLE, embedding_row_bytes=ROW)
    assert reads.step_bytes(1) == LINEARS + NORMS + TABLE + ROW
    assert reads.step_bytes(32) == LINEARS + NORMS + TABLE + 32 * ROW


def test_a_small_step_reads_the_packed_copies() -> None:
    """Every decoder linear layer kept as Q4 blocks for steps of up to 16
    tokens, the LM head as int8 rows for up to 8 (their bytes as laid out,
    whatever the values)."""
    model = tiny_llama()
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            rows, cols = module.weight.shape
            data = torch.zeros(-(-rows // 16), cols // 32, 320, dtype=torch.uint8)
            empty = torch.empty(0, dtype=torch.float32)
            module.packed = CpuQuantWeight("q4_cpu", data, empty, rows, cols, 16)
    head = model.lm_head
    codes, scales = torch.zeros(512, 64, dtype=torch.int8), torch.zeros(512)
    head.packed = PackedWeight("int8", codes, scales, 512, 64, 8)
    reads = weight_reads(model)
    assert reads == WeightReads(
        dense_bytes=NORMS,
        packed=[PackedReads(8, INT8_HEAD, TABLE), PackedReads(16, Q4_LINEARS, LINEARS)],
        embedding_row_bytes=ROW,
    )
    assert reads.step_bytes(1) == NORMS + Q4_LINEARS + INT8_HEAD + ROW
    assert reads.step_bytes(8) == NORMS + Q4_LINEARS + INT8_HEAD + 8 * ROW
    assert reads.step_bytes(9) == NORMS + Q4_LINEARS + TABLE + 9 * ROW
    assert reads.step_bytes(17) == NORMS + LINEARS + TABLE + 17 * ROW


def test_a_moe_step_reads_the_experts_its_tokens_pick() -> None:
    """gpt-oss-20b's shape (32 experts, top 4, biased experts), built on the
    meta device: the experts apart from the dense bytes, one token reads 4
    of 32 of them, 32 tokens the expectation under uniform routing."""
    arch = SHAPES["gpt-oss-20b"]
    with torch.device("meta"):
        model = model_class(arch)(arch, torch.bfloat16)
    reads = weight_reads(model)
    hidden, inter = arch.hidden_size, arch.moe_intermediate_size
    layer = 3 * hidden * inter + 2 * inter + hidden  # w13 and w2 of one expert, and their biases
    experts = arch.num_hidden_layers * arch.num_experts * layer * 2
    assert reads.experts == [ExpertReads(32, 4, experts)]
    everything = sum(p.numel() * p.element_size() for p in model.parameters())  # sinks: float32
    embed_table = arch.vocab_size * arch.hidden_size * 2
    assert reads.dense_bytes == everything - experts - embed_table
    assert reads.step_bytes(1) == reads.dense_bytes + experts // 8 + reads.embedding_row_bytes
    uniform = experts * (1 - (28 / 32) ** 32)
    assert reads.step_bytes(32) == reads.dense_bytes + round(uniform) + 32 * hidden * 2


def test_ranks_add_up_their_reads() -> None:
    first = WeightReads(10, [PackedReads(16, 3, 9)], embedding_row_bytes=5)
    last = WeightReads(20, [PackedReads(8, 1, 4), PackedReads(16, 2, 6)], embedding_row_bytes=0)
    both = first.plus(last)
    assert both == WeightReads(30, [PackedReads(8, 1, 4), PackedReads(16, 5, 15)], 5)
    assert both.step_bytes(8) == 30 + 1 + 5 + 8 * 5
    assert both.step_bytes(9) == 30 + 4 + 5 + 9 * 5
    # Two expert-parallel ranks, each half of the experts: one token reads top_k of them.
    half = WeightReads(0, experts=[ExpertReads(8, 2, 400)])
    assert half.plus(half) == WeightReads(0, experts=[ExpertReads(8, 2, 800)])
    assert half.plus(half).step_bytes(1) == 200


@pytest.mark.trio
async def test_the_engine_reports_its_model_s_reads(tiny_hf_dir: Path) -> None:
    """From the engine core's process, and from two pipeline ranks' (each
    its layers; the first the embedding, the last the tied LM head):
    together what one rank reads."""
    options = {"device": "cpu", "dtype": "float32", "weight_packing": "none"}
    async with asyncstep.open_engine(tiny_hf_dir, **options) as engine:
        alone = engine.weight_reads
    assert alone is not None and alone.embedding_row_bytes == 32 * F32
    async with asyncstep.open_engine(tiny_hf_dir, pipeline_parallel_size=2, **options) as engine:
        assert engine.weight_reads == alone
