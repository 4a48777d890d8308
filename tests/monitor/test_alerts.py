"""Alerts (monitor/alerts.py): each rule fires and stays quiet where it should, once per window;
the tracker warns, writes a text entry and count scalars and calls on_alert; a healthy run raises
none and a 30x learning-rate spike raises one within a snapshot or two."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.alerts import ALERT_KINDS, Alert, AlertRules, AlertWatch
from spectral_callbacks.monitor.options import ConfigurationError, MonitorOptions
from spectral_callbacks.names import MatrixLabel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import alert_thresholds  # noqa: E402
from tiny_models import RecordingLogger  # noqa: E402

TARGETS = [
    MatrixLabel(name="q", layer=0, role="Q"),
    MatrixLabel(name="k", layer=0, role="K"),
]


def row(rank: float = 10.0, sigma: float = 1.0, **extra: float) -> dict[str, float]:
    return {"stable_rank": rank, "spectral_norm": sigma, "frobenius_norm": 3.0, **extra}


def kinds(alerts: list[Alert]) -> list[tuple[str, str]]:
    return sorted((a.kind, a.matrix) for a in alerts)


def test_each_rule_fires_past_its_threshold_and_not_below() -> None:
    rules = AlertRules(0.5, 2.0, esd_alpha_low=2.0, esd_alpha_high=6.0, window=100, after_step=0)
    watch = AlertWatch(TARGETS, rules)
    assert watch.check(0, {"q": row(), "k": row()}) == []
    # q: rank falls 60 % (> 50 %), sigma grows 2.5x (> 2x); k: 40 % and 1.9x stay quiet.
    got = watch.check(10, {"q": row(4.0, 2.5), "k": row(6.0, 1.9)})
    assert kinds(got) == [("rank_collapse", "q"), ("sigma_growth", "q")]
    collapse = next(a for a in got if a.kind == "rank_collapse")
    assert collapse.value == pytest.approx(0.6) and collapse.since_step == 0
    got = watch.check(20, {"q": row(esd_alpha=1.5), "k": row(esd_alpha=6.5)})
    assert kinds(got) == [("esd_alpha_high", "k"), ("esd_alpha_low", "q")]
    got = watch.check(30, {"q": row(math.nan, math.nan) | {"frobenius_norm": math.nan}})
    assert kinds(got) == [("non_finite", "q")]
    # what each kind's value is in (before: one `value` column, a fraction, a factor or an α)
    assert {kind: Alert(kind, 0, "q", 0, "Q", 0.0, 0.0).unit for kind in ALERT_KINDS} == {
        "rank_collapse": "fraction",
        "sigma_growth": "factor",
        "esd_alpha_low": "ESD α",
        "esd_alpha_high": "ESD α",
        "non_finite": "",
        "logit_growth": "factor",
    }
    assert watch.counts == {
        "rank_collapse": 1,
        "sigma_growth": 1,
        "esd_alpha_low": 1,
        "esd_alpha_high": 1,
        "non_finite": 1,
        "logit_growth": 0,
    }


def test_an_alert_is_raised_once_per_kind_and_matrix_per_window() -> None:
    watch = AlertWatch(TARGETS, AlertRules(esd_alpha_low=2.0, after_step=0, window=50))
    watch.check(0, {"q": row(esd_alpha=1.0)})
    assert [a.step for a in watch.check(10, {"q": row(esd_alpha=1.0)})] == []
    assert watch.check(40, {"q": row(esd_alpha=1.0)}) == []
    assert [a.kind for a in watch.check(50, {"q": row(esd_alpha=1.0)})] == ["esd_alpha_low"]
    # The first alert came at step 0 and the next at 50: a gap of one window.
    assert watch.counts["esd_alpha_low"] == 2


def test_the_esd_band_is_off_by_default() -> None:
    watch = AlertWatch(TARGETS, AlertRules(after_step=0))
    assert watch.check(0, {"q": row(esd_alpha=0.5), "k": row(esd_alpha=50.0)}) == []


def test_comparisons_look_back_one_window_and_only_from_after_step() -> None:
    watch = AlertWatch(TARGETS, AlertRules(esd_alpha_high=6.0, after_step=100, window=50))
    watch.check(0, {"q": row(100.0)})  # early collapse of the lifecycle: not read
    assert watch.check(100, {"q": row(10.0, esd_alpha=9.0)}) != []  # ESD band armed at 100
    assert kinds(watch.check(140, {"q": row(2.0)})) == [("rank_collapse", "q")]
    watch = AlertWatch(TARGETS, AlertRules(after_step=0, window=50))
    watch.check(0, {"q": row(10.0)})
    assert watch.check(60, {"q": row(2.0)}) == []  # step 0 is more than a window back


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        (lambda: AlertRules(rank_drop=1.5), r"`rank_drop` must be a fraction in \(0, 1\).*got 1.5"),
        (lambda: AlertRules(sigma_growth=0.5), r"`sigma_growth` must be a factor > 1.*got 0.5"),
        (
            lambda: AlertRules(esd_alpha_low=2.0, esd_alpha_high=1.0),
            r"`esd_alpha_high` must be None or a number above 2.0, e.g. 6.0, got 1.0",
        ),
        (lambda: AlertRules(window=0), r"`window` must be a positive int of steps, got 0"),
        (lambda: "loud", r"`alerts` must be None or an AlertRules, got 'loud'"),
    ],
)
def test_bad_rules_are_refused_where_they_enter(rules: Callable[[], object], match: str) -> None:
    # AlertRules checks itself: a bad threshold fails where the rules are built.
    with pytest.raises(ConfigurationError, match=match):
        MonitorOptions(alerts=rules())


def test_on_alert_must_be_callable() -> None:
    with pytest.raises(ConfigurationError, match=r"`on_alert` must be None or a function.*got 3"):
        MonitorOptions(on_alert=3)


def test_the_tracker_warns_writes_text_and_counts_and_calls_the_hook(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    seen: list[Alert] = []
    rules = AlertRules(after_step=0, window=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SpectralTracker(
            model,
            logdir=tmp_path,
            figures=False,
            synchronous=True,
            alerts=rules,
            on_alert=seen.append,
        ) as tracker:
            tracker.step(1)
            with torch.no_grad():
                model.linear1.weight.mul_(4.0)  # sigma_1 x4 (> 3x): one sigma_growth alert
            tracker.step(2)
    assert [(a.kind, a.matrix, a.step) for a in seen] == [("sigma_growth", "linear1.weight", 2)]
    assert any("sigma_growth in 'linear1.weight'" in str(w.message) for w in caught)
    reader = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    reader.Reload()
    counts = {kind: reader.Scalars(f"spectral_alerts/{kind}")[-1].value for kind in ALERT_KINDS}
    assert counts == {kind: float(kind == "sigma_growth") for kind in ALERT_KINDS}
    texts = reader.Tensors("spectral_alerts/text_summary")
    assert [event.step for event in texts] == [2]
    text = texts[0].tensor_proto.string_val[0].decode()
    assert "| 2 | sigma_growth | linear1.weight |" in text
    # The same rules replayed over the logged event files (the benchmark's reading of a run)
    # raise the same alert.
    replayed = alert_thresholds.replay(alert_thresholds.read_snapshots(tmp_path), rules)
    assert [(a.kind, a.step, a.layer, a.role) for a in replayed] == [
        (a.kind, a.step, a.layer, a.role) for a in seen
    ]


def test_a_resumed_run_counts_on_and_does_not_repeat_an_alert_within_its_window() -> None:
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    options = dict(figures=False, synchronous=True, alerts=AlertRules(after_step=0, window=10))
    tracker = SpectralTracker(model, writers=[RecordingLogger()], **options)
    tracker.step(1)
    with torch.no_grad():
        model.linear1.weight.mul_(4.0)  # one sigma_growth alert at step 2
    tracker.step(2)
    state = tracker.state_dict()
    tracker.close()

    resumed, seen = RecordingLogger(), []
    tracker = SpectralTracker(
        model, writers=[resumed], start_step=2, state=state, on_alert=seen.append, **options
    )
    tracker.close(3)  # sigma_1 is still 4x its value at step 1, one step after the alert
    assert resumed.series("spectral_alerts/sigma_growth") == {3: 1.0}
    assert seen == []


def test_alerts_none_logs_no_alert_scalars(tmp_path: Path) -> None:
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    with SpectralTracker(model, logdir=tmp_path, figures=False, synchronous=True, alerts=None) as t:
        t.step(1)
    reader = event_accumulator.EventAccumulator(str(tmp_path))
    reader.Reload()
    assert not [tag for tag in reader.Tags()["scalars"] if tag.startswith("spectral_alerts/")]


# --- along training: the defaults on a healthy run and on a spiked one -------------------------

QUICK = {"depth": 2, "width": 128, "heads": 2, "steps": 200}
SPIKE_STEP = 150  # the first update at 30x is step 151


@pytest.mark.slow
def test_the_default_rules_raise_nothing_on_a_healthy_run(tmp_path: Path) -> None:
    run = alert_thresholds.train(**QUICK, logdir=tmp_path)
    assert run.alerts == []
    assert alert_thresholds.replay(run.snapshots) == []
    assert max(run.snapshots) == QUICK["steps"]  # the run was watched to its end


@pytest.mark.slow
def test_a_30x_learning_rate_spike_raises_an_alert_within_two_snapshots(tmp_path: Path) -> None:
    run = alert_thresholds.train(**QUICK, spike_step=SPIKE_STEP, spike_steps=10, logdir=tmp_path)
    before = run.losses[SPIKE_STEP]
    assert max(run.losses[s] for s in range(SPIKE_STEP + 1, SPIKE_STEP + 20)) > before + 1.0
    first = min(alert.step for alert in run.alerts)
    assert SPIKE_STEP < first <= SPIKE_STEP + 20  # snapshots every 10 steps: the 1st or 2nd after
    replayed = alert_thresholds.replay(run.snapshots)
    assert sorted((a.kind, a.step, a.layer, a.role) for a in replayed) == sorted(
        (a.kind, a.step, a.layer, a.role) for a in run.alerts
    )


def test_logit_growth_reads_a_layers_max_over_heads_once_per_window() -> None:
    heads = [
        MatrixLabel(f"h.0.attn[head {h}]", 0, "heads", head=h, attention_layer="h.0.attn")
        for h in range(3)
    ]
    watch = AlertWatch(heads, AlertRules(after_step=0, window=100, logit_growth=1.5))

    def snapshot(step: int, bounds: list[float]) -> list[Alert]:
        values = {f"h.0.attn[head {h}]": {"qk_spectral_norm": v} for h, v in enumerate(bounds)}
        return watch.check(step, values)

    assert snapshot(10, [1.0, 2.0, 0.5]) == []
    assert snapshot(20, [2.9, 1.0, 0.5]) == []  # the max grew 1.45x: no alert
    [alert] = snapshot(30, [1.0, 3.1, 0.5])  # 3.1 / 2.0 = 1.55x
    assert (alert.kind, alert.matrix, alert.layer, alert.role, alert.since_step) == (
        "logit_growth",
        "h.0.attn",
        0,
        "heads",
        10,
    )
    assert alert.value == pytest.approx(1.55)
    assert "grew 1.55x" in alert.describe()
    assert snapshot(40, [5.0, 1.0, 1.0]) == []  # once per window
    assert watch.counts["logit_growth"] == 1
    resumed = AlertWatch(heads, watch.rules)
    resumed.load_state_dict(watch.state_dict())
    assert resumed.check(60, {"h.0.attn[head 0]": {"qk_spectral_norm": 9.0}}) == []  # same window
    assert [
        a.kind for a in resumed.check(131, {"h.0.attn[head 0]": {"qk_spectral_norm": 9.0}})
    ] == ["logit_growth"]


def test_logit_growth_reads_the_qk_norm_bound_where_a_layer_has_qk_norm() -> None:
    """Behind QK-norm the projections' ``qk_spectral_norm`` does not bound the logits: a layer
    that logs ``qk_norm_logit_bound`` is read on it, whatever its ``qk_spectral_norm`` does."""
    heads = [
        MatrixLabel(f"h.0.attn[head {h}]", 0, "heads", head=h, attention_layer="h.0.attn")
        for h in range(2)
    ]
    watch = AlertWatch(heads, AlertRules(after_step=0, window=100, logit_growth=3.0))

    def snapshot(step: int, projections: float, bound: float) -> list[Alert]:
        row = {"qk_spectral_norm": projections, "qk_norm_logit_bound": bound}
        return watch.check(step, {head.name: row for head in heads})

    assert snapshot(10, 1.0, 8.0) == []
    assert snapshot(20, 50.0, 9.0) == []  # the projections grew 50x, the bound 1.125x
    [alert] = snapshot(30, 60.0, 25.0)  # the bound grew 3.125x
    assert (alert.kind, alert.matrix, alert.since_step) == ("logit_growth", "h.0.attn", 10)
    assert alert.value == pytest.approx(25.0 / 8.0)


def test_logit_growth_must_be_a_factor_above_one() -> None:
    with pytest.raises(ConfigurationError, match=r"`logit_growth` must be a factor > 1"):
        MonitorOptions(alerts=AlertRules(logit_growth=1.0))


def test_an_alert_names_its_stack_and_its_unit_in_the_table(tmp_path: Path) -> None:
    # before: no stack (a T5's encoder and decoder layer 0 read alike) and no unit in the table
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4
    )
    model = transformers.T5ForConditionalGeneration(config)
    seen: list[Alert] = []
    with (
        warnings.catch_warnings(record=True),
        SpectralTracker(
            model,
            logdir=tmp_path,
            figures=False,
            synchronous=True,
            alerts=AlertRules(after_step=0, window=10),
            on_alert=seen.append,
        ) as tracker,
    ):
        tracker.step(1)
        with torch.no_grad():
            model.decoder.block[0].layer[0].SelfAttention.q.weight.mul_(4.0)  # sigma_1 x4
        tracker.step(2)
    assert [(a.kind, a.stack, a.layer, a.role, a.unit) for a in seen] == [
        ("sigma_growth", "dec", 0, "Q", "factor")
    ]
    assert "(dec L0 Q)" in seen[0].describe()
    reader = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    reader.Reload()
    text = reader.Tensors("spectral_alerts/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| value | threshold | unit |" in text
    assert f"| dec | 0 | Q | {seen[0].value:.4g} | 3 | factor | 0 |" in text


def test_sigma_growth_is_measured_from_the_lowest_value_of_the_window() -> None:
    # 1 -> 2 -> 4 within one window: each step only 2x its previous snapshot, 4x the window's
    # lowest (> 3x): the alert comes at 4 and names the window's first step.
    watch = AlertWatch(TARGETS, AlertRules(after_step=0, window=50, sigma_growth=3.0))
    assert watch.check(0, {"q": row(sigma=1.0)}) == []
    assert watch.check(10, {"q": row(sigma=2.0)}) == []
    (alert,) = watch.check(20, {"q": row(sigma=4.0)})
    assert (alert.kind, alert.since_step) == ("sigma_growth", 0)
    assert alert.value == pytest.approx(4.0)


def test_the_alert_table_reads_back_as_the_alerts_it_was_written_from() -> None:
    from spectral_callbacks.monitor.alerts import alert_rows, alert_table

    raised = [
        Alert("sigma_growth", 300, "h.0.attn.c_attn.weight[Q]", 0, "Q", 2.5, 2.0, 250),
        Alert("rank_collapse", 300, "decoder.block.1.q.weight", 1, "Q", 0.75, 0.7, 260, "dec"),
        Alert("non_finite", 310, "h.1.attn.c_proj.weight", 1, "O", math.nan, math.nan, None),
    ]
    rows = alert_rows(alert_table(raised))
    assert rows == [
        {
            "step": a.step,
            "kind": a.kind,
            "matrix": a.matrix,
            "stack": a.stack or None,  # an empty cell reads as None
            "layer": a.layer,
            "role": a.role,
            "value": None if math.isnan(a.value) else a.value,
            "threshold": None if math.isnan(a.threshold) else a.threshold,
            "unit": a.unit or None,
            "since_step": a.since_step,
        }
        for a in raised
    ]
