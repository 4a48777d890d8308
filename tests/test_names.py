import pytest

from spectral_callbacks.names import layer_label, parse_tag, scalar_tag


@pytest.mark.parametrize("layer", [0, 7, 11, 99])
@pytest.mark.parametrize("role", ["Q", "MLP_down", "KV_down"])
def test_tag_round_trip(layer: int, role: str) -> None:
    tag = scalar_tag("energy_rank_90", layer, role, num_layers=100)
    assert parse_tag(tag) == ("energy_rank_90", layer, role)


def test_tags_sort_by_depth() -> None:
    tags = [scalar_tag("alpha", i, "Q", num_layers=12) for i in (10, 2, 0)]
    assert sorted(tags) == [scalar_tag("alpha", i, "Q", num_layers=12) for i in (0, 2, 10)]


def test_monitor_tags_are_not_spectral_metrics() -> None:
    assert parse_tag("spectral_monitor/svd_ms") is None
    assert parse_tag("spectral_monitor/L00/Q") is None


def test_negative_layer_is_rejected() -> None:
    with pytest.raises(ValueError, match="`layer` must be a non-negative int"):
        layer_label(-1)
