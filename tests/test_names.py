import re
from pathlib import Path

import pytest

from spectral_callbacks.names import TIDY_COLUMNS, layer_label, parse_tag, scalar_tag


@pytest.mark.parametrize("layer", [0, 7, 11, 99])
@pytest.mark.parametrize("role", ["Q", "MLP_down", "KV_down"])
def test_tag_round_trip(layer: int, role: str) -> None:
    tag = scalar_tag("energy_rank_90", layer, role, num_layers=100)
    assert parse_tag(tag) == ("energy_rank_90", layer, role, "", None, "", None)


@pytest.mark.parametrize("stack", ["", "enc", "dec", "vision"])
@pytest.mark.parametrize("expert", [None, 0, 7, 255])
@pytest.mark.parametrize("aggregate", ["", "mean", "min", "max"])
def test_stack_and_expert_tags_round_trip(stack: str, expert: int | None, aggregate: str) -> None:
    if expert is not None and aggregate:
        return  # an aggregate is over experts, never of one
    tag = scalar_tag("alpha", 3, "MLP_down", 12, stack=stack, expert=expert, aggregate=aggregate)
    assert parse_tag(tag) == ("alpha", 3, "MLP_down", stack, expert, aggregate, None)
    mean = scalar_tag("alpha", None, "Q_cross", stack=stack)
    assert parse_tag(mean) == ("alpha", None, "Q_cross", stack, None, "", None)


@pytest.mark.parametrize("stack", ["", "dec"])
@pytest.mark.parametrize("head", [0, 7, 63])
def test_head_tags_round_trip(stack: str, head: int) -> None:
    tag = scalar_tag("qk_spectral_norm", 3, "heads", 12, stack=stack, head=head)
    assert tag == f"spectral_qk_spectral_norm/{stack + '/' if stack else ''}L03/H{head:02d}/heads"
    assert parse_tag(tag) == ("qk_spectral_norm", 3, "heads", stack, None, "", head)
    biggest = scalar_tag("qk_spectral_norm", 3, "heads", 12, stack=stack, aggregate="max")
    assert parse_tag(biggest) == ("qk_spectral_norm", 3, "heads", stack, None, "max", None)


def test_one_stack_keeps_the_decoder_only_names() -> None:
    assert scalar_tag("stable_rank", 3, "Q", stack="") == "spectral_stable_rank/L03/Q"
    assert scalar_tag("stable_rank", 3, "Q_cross", stack="dec") == (
        "spectral_stable_rank/dec/L03/Q_cross"
    )


def test_a_stack_named_mean_is_refused() -> None:
    from spectral_callbacks.names import check_stack

    with pytest.raises(ValueError, match="`stack` must be lowercase"):
        check_stack("mean")
    with pytest.raises(ValueError, match="'Enc'"):
        check_stack("Enc")


def test_tags_sort_by_depth() -> None:
    tags = [scalar_tag("alpha", i, "Q", num_layers=12) for i in (10, 2, 0)]
    assert sorted(tags) == [scalar_tag("alpha", i, "Q", num_layers=12) for i in (0, 2, 10)]


def test_monitor_tags_are_not_spectral_metrics() -> None:
    assert parse_tag("spectral_monitor/svd_ms") is None
    assert parse_tag("spectral_monitor/L00/Q") is None


def test_negative_layer_is_rejected() -> None:
    with pytest.raises(ValueError, match="`layer` must be a non-negative int"):
        layer_label(-1)


def test_the_tidy_columns_are_the_ones_docs_cli_md_states_in_order() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    section = text.split("## Tidy rows", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert documented == list(TIDY_COLUMNS)


def test_the_parameter_table_of_the_callback_docs_names_every_option() -> None:
    # before: `experts`, `alerts` and `on_alert` (and `example_input`, `circuits`) had no row
    import re
    from pathlib import Path

    from spectral_callbacks.monitor.options import option_names

    doc = (Path(__file__).resolve().parents[1] / "docs" / "callback.md").read_text()
    table = doc[doc.index("| parameter |") : doc.index("## Validation")]
    named = {
        name
        for line in table.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`(\w+)`", line.split("|")[1])
    }
    assert [name for name in option_names() if name not in named] == []
