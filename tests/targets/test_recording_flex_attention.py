"""Recording the first training forward changes nothing it computes, through a compiled attention
kernel: torchtitan's Llama 3 with its own language-model attention (compiled FlexAttention with a
block-causal mask), built by its config code on the CPU.

The recording's torch-function mode is on the stack when the compiled ``flex_attention`` runs, so
dynamo traces through it; where the compiled function falls back to eager, dynamo compiles the
frames its eager code calls, and the mode's handler must run there as the Python it is (compiled
as a frame of its own it returned ``query.dim()`` as ``False``). FlexAttention has no backward on
the CPU: with every weight trainable the forward raises that, with the tracker as without it;
with the attention path frozen (only the head trains) the CPU runs the whole training step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import RecordingLogger

from spectral_callbacks import SpectralTracker

pytest.importorskip("torchtitan")
from stack_models import StackModel, titan_llama3  # noqa: E402

VOCAB = 128


def flex_llama(frozen: bool) -> StackModel:
    """The same initial weights each call; ``frozen``: only the head and its norm train."""
    torch.manual_seed(0)
    stack = titan_llama3(fuse_qkv=True, flex=True)
    if frozen:
        for name, parameter in stack.model.named_parameters():
            parameter.requires_grad_(name.split(".")[0] in ("lm_head", "norm"))
    return stack


def training_step(stack: StackModel) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Step 0's loss and the gradients it leaves."""
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = stack.forward(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    grads = [p.grad for p in stack.model.parameters() if p.grad is not None]
    return loss.detach(), grads


@pytest.mark.parametrize("follow", ["auto", True])
def test_recording_a_flex_attention_forward_raises_what_it_raises_without_the_tracker(
    follow: bool | str,
) -> None:
    stack = flex_llama(frozen=False)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        training_step(stack)
    stack = flex_llama(frozen=False)
    tracker = SpectralTracker(
        stack.model, writers=[RecordingLogger()], roles_from_first_forward=follow
    )
    try:
        with pytest.raises(
            NotImplementedError, match="FlexAttention does not support backward on CPU"
        ):
            training_step(stack)
    finally:
        tracker.close()


@pytest.mark.parametrize("follow", ["auto", True])
def test_recording_a_flex_attention_forward_computes_what_it_computes_without_the_tracker(
    follow: bool | str,
) -> None:
    stack = flex_llama(frozen=True)
    loss, grads = training_step(stack)
    stack = flex_llama(frozen=True)
    tracker = SpectralTracker(
        stack.model, writers=[RecordingLogger()], roles_from_first_forward=follow
    )
    try:
        recorded_loss, recorded_grads = training_step(stack)
        read = {(t.stack, t.layer, t.role) for t in tracker.targets}
    finally:
        tracker.close()
    assert torch.equal(recorded_loss, loss)
    assert len(recorded_grads) == len(grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(recorded_grads, grads, strict=True))
    assert read == set(stack.expected)
