import math

import numpy as np
import torch
from torch import nn

from kvserve.measure.request_lengths import lognormal_lengths
from kvserve.measure.roofline import Machine, decode_step_bytes, linear_params, pct_of_bandwidth, workload_flops
from kvserve.model.llama import LlamaForCausalLM
from tests.conftest import TINY


def test_linear_params_count_the_models_own_matmul_weights() -> None:
    """Against the parameters of the model's nn.Linear layers (the LM head apart), not the formula."""
    with torch.device("meta"):
        model = LlamaForCausalLM(TINY)
    layers = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and name != "lm_head")
    assert linear_params(TINY) == (layers, model.lm_head.weight.numel())


def test_flops_and_bytes_of_one_request() -> None:
    layers, head = linear_params(TINY)
    # One prompt token and one generated token: 2 tokens through the layers, one through the head,
    # attention over the (query, key) pairs (1,1), (2,1), (2,2).
    attn = 4 * TINY.num_heads * TINY.head_dim * TINY.num_layers
    assert workload_flops(TINY, [(1, 1)]) == 2 * layers * 2 + 2 * head + attn * 3
    step = decode_step_bytes(TINY, torch.float32, context=10, kv_bytes_per_token=100.0)
    assert step == 4 * (layers + head) + 1000
    # Reading those bytes in the time the machine's bandwidth allows is 100% of it.
    assert math.isclose(pct_of_bandwidth(step, step / 1e9, Machine(read_gb_s=1.0, matmul_gflop_s=1.0)), 100.0)


def test_lognormal_lengths_are_bounded_and_pin_the_median() -> None:
    lengths = lognormal_lengths(np.random.default_rng(0), median=100, sigma=0.5, n=20_000, low=4, high=300)
    assert lengths.dtype == np.int64 and lengths.min() >= 4 and lengths.max() <= 300
    assert 95 <= np.median(lengths) <= 105
