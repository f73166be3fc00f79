"""The compiled decode step (`generate(compiled=True)`, models/nets/decoding.py) gives the
uncompiled path's tokens, compiles once for a generation rather than once a token, and keeps its
cache's buffers between calls."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from {{ cookiecutter.package_name }}.models.nets.decoding import (
    Decoder,
)
from {{ cookiecutter.package_name }}.models.nets.gpt import GPT
from {{ cookiecutter.package_name }}.models.nets.llama import Llama

VOCAB, CONTEXT = 97, 40


def network(family: str) -> Decoder:
    torch.manual_seed(0)
    if family == "gpt":
        return GPT(vocab_size=VOCAB, block_size=CONTEXT, n_layer=2, n_head=4, n_embd=32).eval()
    # Grouped-query attention: two query heads share each key/value head.
    return Llama(
        vocab_size=VOCAB, block_size=CONTEXT, n_layer=2, n_head=4, n_kv_head=2, n_embd=32
    ).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts, two of them shorter and left-padded."""
    idx = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    real = torch.ones(3, 10, dtype=torch.bool)
    real[0, :4] = False
    real[2, :7] = False
    return idx, real


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_compiled_step_gives_the_tokens_of_the_uncompiled_one(family: str) -> None:
    """Greedy, token for token: one length, left-padded rows with counts of their own and a stop
    token, and past the context (the cache refilled from the last window)."""
    net = network(family)
    idx, real = prompts()
    cases = [
        dict(idx=idx, max_new_tokens=20),
        dict(idx=idx, max_new_tokens=[20, 7, 14], padding_mask=real, stop_token=5),
        dict(idx=idx[:1], max_new_tokens=CONTEXT + 15),  # refills the cache twice
    ]
    for case in cases:
        eager = net.generate(**case, temperature=0.0)
        compiled = net.generate(**case, temperature=0.0, compiled=True)
        assert torch.equal(compiled, eager), case
        # Again, on the buffers kept from the call before (zeroed, rewritten).
        assert torch.equal(net.generate(**case, temperature=0.0, compiled=True), eager)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_generation_compiles_once_not_once_a_token(rows: int) -> None:
    """Every step has the same shapes and strides: 30 tokens, then 30 more in a second call, are
    one compilation (a shape or stride that moved with the position would recompile each token,
    up to dynamo's limit, and then run uncompiled)."""
    net = network("gpt")
    idx = torch.randint(0, VOCAB, (rows, 6), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    counters.clear()
    net.generate(idx, 30, temperature=0.0, compiled=True)
    net.generate(idx, 30, temperature=0.0, compiled=True)
    assert counters["stats"]["unique_graphs"] == 1
    assert net.__dict__["_kept_cache"].keys[0].size(0) == rows


def test_sampling_with_a_seeded_generator_is_the_same_compiled() -> None:
    net = network("llama")
    idx, _ = prompts()
    draws = []
    for compiled in (False, True):
        generator = torch.Generator().manual_seed(3)
        draws.append(
            net.generate(idx, 15, temperature=0.9, top_k=20, compiled=compiled, generator=generator)
        )
    assert torch.equal(draws[0], draws[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_on_a_gpu_the_cuda_graphs_give_the_uncompiled_tokens(family: str) -> None:
    """The step replayed as CUDA graphs, in float32 without TF32 (so that no rounding differs
    between the fused kernels and the uncompiled ones enough to tip a greedy choice)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    net = network(family).cuda()
    idx, real = prompts()
    idx, real = idx.cuda(), real.cuda()
    for case in (
        dict(idx=idx, max_new_tokens=30),
        dict(idx=idx, max_new_tokens=30, padding_mask=real),
    ):
        eager = net.generate(**case, temperature=0.0)
        for _ in range(2):  # recorded, then replayed
            assert torch.equal(net.generate(**case, temperature=0.0, compiled=True), eager)
