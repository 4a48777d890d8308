"""Recording the first training forward costs no activation memory, with activation checkpointing.

A checkpointed forward frees each block's activations as it goes (and recomputes them in the
backward); a record that held them, or held them in reference cycles only the cyclic collector
frees, would keep them all. The bytes of tensors alive are counted (every tensor object the
interpreter tracks, deduplicated by storage: what a record could hold) with the cyclic collector
off, inside the forward
(before the head), at its end and after the backward, with the tracker reading the roles from the
forward and without one. What the record keeps instead: shapes of the data (meta-device stand-ins)
and small integer index tensors, enough for the replay that reads a fused layout; an index too
large to keep stops the replay (the role is left to the names) rather than guessing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensor_memory import bytes_alive, collector_off
from tiny_models import RecordingLogger
from torch import nn
from torch.utils.checkpoint import checkpoint

from spectral_callbacks import SpectralTracker
from spectral_callbacks.targets import dataflow
from spectral_callbacks.targets.dataflow import record
from spectral_callbacks.targets.roles import roles_from_recording

WIDTH, HEADS, LAYERS, VOCAB = 128, 4, 3, 64
BATCH, TOKENS = 2, 256
# Tensors of the measurement itself and of the run's Python objects: far below one activation of
# one block (BATCH * TOKENS * WIDTH * 4 bytes = 256 KiB; the MLP's are 4x that).
SLACK = 64 * 1024


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, WIDTH)
        self.k_proj = nn.Linear(WIDTH, WIDTH)
        self.v_proj = nn.Linear(WIDTH, WIDTH)
        self.o_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, HEADS, -1).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, HEADS, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, HEADS, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """A Llama-style block (gated MLP) whose forward runs under ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.input_layernorm = nn.LayerNorm(WIDTH)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.LayerNorm(WIDTH)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(WIDTH, 4 * WIDTH),
                "up_proj": nn.Linear(WIDTH, 4 * WIDTH),
                "down_proj": nn.Linear(4 * WIDTH, WIDTH),
            }
        )

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        mlp = self.mlp
        return x + mlp["down_proj"](F.silu(mlp["gate_proj"](h)) * mlp["up_proj"](h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self._forward, x, use_reentrant=self.reentrant)
        return out


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(reentrant) for _ in range(LAYERS))
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x)
        out: torch.Tensor = self.lm_head(x)
        return out


def hf_llama(reentrant: bool) -> tuple[nn.Module, nn.Module]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=WIDTH,
        intermediate_size=4 * WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=TOKENS,
    )
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model, model.lm_head


def hand_written(reentrant: bool) -> tuple[nn.Module, nn.Module]:
    model = Checkpointed(reentrant)
    return model, model.lm_head


def measure(
    build: Callable[[bool], tuple[nn.Module, nn.Module]], reentrant: bool, tracked: bool
) -> dict[str, int]:
    """Bytes alive above the start inside the forward (before the head), at its end and after the
    backward, with the cyclic collector off from before the tracker is made to the end."""
    torch.manual_seed(0)
    model, head = build(reentrant)
    model.train()
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
    with collector_off():
        tracker = None
        if tracked:
            tracker = SpectralTracker(
                model, writers=[RecordingLogger()], roles_from_first_forward=True, synchronous=True
            )
        start = bytes_alive()
        inside: list[int] = []
        head.register_forward_pre_hook(lambda module, args: inside.append(bytes_alive()))
        logits = model(ids)
        logits = getattr(logits, "logits", logits)
        end = bytes_alive()
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        del logits
        loss.backward()
        del loss
        after = bytes_alive()
        if tracker is not None:
            assert tracker.targets, "the tracker read no roles from the forward"
            tracker.close()
    return {"inside": inside[0] - start, "end": end - start, "backward": after - start}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("build", [hand_written, hf_llama], ids=["checkpoint", "hf"])
def test_recording_a_checkpointed_forward_keeps_no_activation_alive(
    build: Callable[[bool], tuple[nn.Module, nn.Module]], reentrant: bool
) -> None:
    plain = measure(build, reentrant, tracked=False)
    recorded = measure(build, reentrant, tracked=True)
    for point in ("inside", "end", "backward"):
        assert recorded[point] <= plain[point] + SLACK, (point, recorded, plain)


class _PermutedQKV(nn.Module):
    """A fused ``[q; k; v]`` projection whose output features are reordered by an index tensor
    before the heads are split: the layout is readable only through that index."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.register_buffer(
            "order", torch.randperm(48, generator=torch.Generator().manual_seed(0))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        mixed = self.qkv(x).index_select(-1, self.order)  # (B, T, 48), features reordered
        q, k, v = mixed.view(B, T, 3, 2, 8).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(B, T, 16))


def _rows_read(model: nn.Module) -> dict[str, tuple[int, ...] | None]:
    with record(model) as recording:
        model(torch.randn(1, 3, 16))
    kept = [leaf for op in recording.ops for leaf in op.template if isinstance(leaf, torch.Tensor)]
    assert kept and all(t.is_meta or not t.is_floating_point() for t in kept)
    flow = roles_from_recording(recording)
    recording.release()
    assert not recording.ops and not recording.values
    return {role.role: role.rows for role in flow.roles if role.parameter == "qkv.weight"}


def test_the_record_keeps_shapes_of_data_and_small_index_tensors_for_the_replay() -> None:
    model = _PermutedQKV()
    order = model.order.tolist()
    rows = _rows_read(model)
    for part, role in enumerate("QKV"):  # part p's rows come from order[16 p : 16 (p + 1)]
        assert rows[role] == tuple(order[part * 16 : (part + 1) * 16])


def test_an_index_too_large_to_keep_stops_the_replay_rather_than_guessing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dataflow, "INDEX_BYTES", 0)
    assert _rows_read(_PermutedQKV()) == {}
