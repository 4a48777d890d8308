"""The measured per-head max logit an attention call hands out, logged beside its heads' QK values
(SpectralTracker.observe_max_logits): the running maximum between snapshots, per head, equal to
the maximum of what the calls handed; nothing of ours computes a logit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from spectral_callbacks.monitor.max_logits import MaxLogits
from spectral_callbacks.monitor.tracker import SpectralTracker
from spectral_callbacks.names import parse_tag

D, HEADS, T = 32, 4, 8


class Attention(torch.nn.Module):
    """Written-out attention that hands the maxima of the logits it computes anyway."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(D, D) for _ in range(4)
        )
        self.num_heads = HEADS
        self.scaling = 0.5
        self.tracker: SpectralTracker | None = None
        self.handed: list[torch.Tensor] = []  # (H,) per forward: the test's reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, _ = x.shape
        q, k, v = (
            p(x).view(B, T_, HEADS, D // HEADS).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        causal = torch.ones(T_, T_, dtype=torch.bool).tril()
        scores = ((q @ k.transpose(-1, -2)) * self.scaling).masked_fill(~causal, -math.inf)
        maxima = scores.amax(-1)  # (B, H, T): what flex's AuxOutput.max_scores holds
        self.handed.append(maxima.detach().double().amax(dim=(0, 2)))
        if self.tracker is not None:
            self.tracker.observe_max_logits(self, maxima)
        y = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T_, D))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, D)
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
        for block in self.layers:
            block.attn = Attention()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = x + block.attn(x)
        return x


class Recorder:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


def test_the_logged_max_logit_is_the_largest_handed_since_the_previous_snapshot() -> None:
    torch.manual_seed(0)
    model = Model()
    writer = Recorder()
    tracker = SpectralTracker(
        model, writers=[writer], circuits=True, synchronous=True, figures=False, every_n_steps=2
    )
    for block in model.layers:
        block.attn.tracker = tracker
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(1, 7):
        model(torch.randint(0, 50, (2, T))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker.step(step)
    tracker.close()
    # forward f (1-based) runs before step f; snapshots at 0 (taken when the first forward is
    # read, after its call handed its maxima), 2, 4, 6
    windows = {0: [0], 2: [1], 4: [2, 3], 6: [4, 5]}
    for step, forwards in windows.items():
        logged = {
            (p.layer, p.head): value
            for tag, value in writer.logged[step].items()
            if (p := parse_tag(tag)) is not None and p.metric == "max_logit" and p.head is not None
        }
        assert set(logged) == {(layer, h) for layer in range(2) for h in range(HEADS)}, step
        for (layer, h), value in logged.items():
            handed = model.layers[layer].attn.handed
            expected = max(float(handed[f][h]) for f in forwards)
            assert value == pytest.approx(expected, rel=1e-6), (step, layer, h)
    at_one = [parse_tag(tag) for tag in writer.logged.get(1, {})]
    assert not any(p is not None and p.metric == "max_logit" for p in at_one)


def test_a_max_logit_of_another_layer_or_head_count_is_refused() -> None:
    model = Model()
    tracker = SpectralTracker(model, writers=[Recorder()], circuits=True, synchronous=True)
    with pytest.raises(ValueError, match=r"`attention` must be an attention layer .* got 'embed'"):
        tracker.observe_max_logits("embed", torch.zeros(1, HEADS, T))
    with pytest.raises(
        ValueError, match=r"`max_scores` must be a \(\.\.\., 4, L\) tensor .* \(1, 3, 8\)"
    ):
        tracker.observe_max_logits(model.layers[0].attn, torch.zeros(1, 3, T))
    tracker.close()


def test_flex_attention_hands_no_max_scores_on_the_cpu() -> None:
    """torch 2.13: the CPU refuses ``max_scores`` (the CUDA test below reads them)."""
    q = torch.randn(1, HEADS, T, 8)
    with pytest.raises(NotImplementedError, match="max scores is not supported on CPU"):
        flex_attention(q, q, q, return_aux=AuxRequest(max_scores=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex max_scores needs CUDA")
def test_flex_attentions_max_scores_are_logged_per_head_on_cuda() -> None:
    torch.manual_seed(0)
    model = Model().cuda()
    writer = Recorder()
    tracker = SpectralTracker(
        model, writers=[writer], circuits=True, synchronous=True, every_n_steps=1
    )
    attention = model.layers[0].attn
    q, k, v = (torch.randn(2, HEADS, 128, 8, device="cuda") for _ in range(3))
    compiled = torch.compile(flex_attention)
    _, aux = compiled(q, k, v, scale=0.5, return_aux=AuxRequest(max_scores=True))
    tracker.step(1)  # no model forward: the first snapshot (step 0) is taken here
    tracker.observe_max_logits(attention, aux)
    tracker.step(2)
    tracker.close(2)
    reference = (q.double() @ k.double().mT * 0.5).amax(dim=(0, 2, 3))
    parsed = [(parse_tag(tag), value) for tag, value in writer.logged[2].items()]
    logged = {
        p.head: value for p, value in parsed if p and p.metric == "max_logit" and p.layer == 0
    }
    for h in range(HEADS):
        assert logged[h] == pytest.approx(float(reference[h]), rel=1e-3)


def test_maxima_of_a_snapshot_never_logged_fold_into_the_next_and_are_not_kept() -> None:
    # a snapshot the engine skipped never reaches rows(): its maxima belong to the next one logged
    heads = [
        SimpleNamespace(name=f"attn[head {h}]", head=h, layout=SimpleNamespace(name="attn"))
        for h in range(2)
    ]
    watch = MaxLogits(heads)
    watch.observe("attn", torch.tensor([[[7.0], [1.0]]]))
    watch.take(5)  # skipped: never logged
    watch.observe("attn", torch.tensor([[[2.0], [3.0]]]))
    watch.take(10)
    assert watch.rows(10) == {
        "attn[head 0]": {"max_logit": 7.0},
        "attn[head 1]": {"max_logit": 3.0},
    }
    assert watch.rows(5) == {} and not watch._taken
