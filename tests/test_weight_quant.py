"""[Note: group-wise weight quantization] (zeroshard/inference/quantization.py): packing round trips at 8 and 4
bits, odd sizes and every group size; dequantized values within the rounding bound; the spec's keys
validated by name."""

from __future__ import annotations

import pytest
import torch

from zeroshard.inference.quantization import QuantSpec, _pack, dequantize, error_bound, quantize, unpack_codes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("count", [1, 2, 7, 64, 129])
def test_packing_round_trips(bits, count):
    codes = torch.randint(0, 1 << bits, (count,), dtype=torch.uint8, generator=torch.Generator().manual_seed(count))
    packed = _pack(codes, bits)
    assert packed.numel() == (count if bits == 8 else -(-count // 2))
    assert torch.equal(unpack_codes(packed, bits, count), codes)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_every_group_size_dequantizes_within_the_rounding_bound(bits, symmetric):
    weight = torch.randn(7, 13, generator=torch.Generator().manual_seed(0)) * 3  # odd sizes
    for group_dim in (0, 1):
        for group_size in range(1, weight.shape[group_dim] + 2):  # up to one larger than the row
            spec = QuantSpec(bits, group_size, group_dim, symmetric)
            q = quantize(weight, spec)
            back = dequantize(q)
            assert back.shape == weight.shape
            slack = 1e-5 * weight.abs().max()  # fp32 arithmetic of the scale
            assert ((back - weight).abs() <= error_bound(q) + slack).all(), (bits, symmetric, group_dim, group_size)
            length = weight.shape[group_dim]
            assert q.scale.shape == (weight.numel() // length, -(-length // group_size))
            # quantizing what came back moves it by less than one step again: the round trip is stable
            again = quantize(back, spec)
            assert ((dequantize(again) - back).abs() <= error_bound(again) + slack).all()


def test_bytes_per_element_and_exact_groups():
    weight = torch.randn(64, 256)
    int4 = quantize(weight, QuantSpec(4, 64, 1, False))
    int8 = quantize(weight, QuantSpec(8, 64, 1, False))
    assert int4.nbytes == weight.numel() // 2 + 2 * 4 * (weight.numel() // 64)  # 0.625 bytes per element
    assert int8.nbytes == weight.numel() + 2 * 4 * (weight.numel() // 64)
    constant = torch.full((4, 8), 0.3)
    assert torch.equal(dequantize(quantize(constant, QuantSpec(4, 8, 1, False))), constant)  # scale 0: exact
    assert torch.allclose(dequantize(quantize(constant, QuantSpec(4, 8, 1, True))), constant, rtol=1e-6, atol=0)
    zeros = torch.zeros(3, 5)
    assert torch.equal(dequantize(quantize(zeros, QuantSpec(4, 2, 1, True))), zeros)
    bf16 = torch.randn(5, 9).to(torch.bfloat16)
    assert dequantize(quantize(bf16, QuantSpec(8, 3)), torch.bfloat16).dtype == torch.bfloat16


def test_the_spec_and_inputs_are_validated_by_name():
    with pytest.raises(ValueError, match="num_bits=3: allowed 8 or 4"):
        QuantSpec(num_bits=3)
    with pytest.raises(ValueError, match="group_size=0"):
        QuantSpec(group_size=0)
    with pytest.raises(ValueError, match="group_dim=-1"):
        QuantSpec(group_dim=-1)
    with pytest.raises(ValueError, match="symmetric='yes'"):
        QuantSpec(symmetric="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"group_dim=1 is not a dimension of a tensor of shape \[5\]"):
        quantize(torch.randn(5), QuantSpec())
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(2, 2, dtype=torch.int64), QuantSpec())
