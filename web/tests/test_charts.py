from __future__ import annotations

from catalog.money import per_million, usd
from web.charts import HEIGHT, LEFT, WIDTH, X_TICKS, bar_chart, nice_ceiling


class BarChartTests:
    def test_it_scales_bars_to_a_round_axis_top_and_keeps_them_inside_the_plot(self) -> None:
        chart = bar_chart(title="t", points=[("a", 1), ("b", 3), ("c", 0)])  # axis 0..4
        assert [bar.height for bar in chart.bars] == [HEIGHT / 4, HEIGHT * 3 / 4, 0]
        assert all(
            LEFT <= bar.x and bar.x + bar.width <= chart.right < WIDTH and bar.y + bar.height == chart.baseline
            for bar in chart.bars
        )
        assert (chart.first_label, chart.last_label, chart.peak) == ("a", "c", "3")

    def test_it_labels_the_value_axis_at_round_values_in_the_chart_format(self) -> None:
        chart = bar_chart(title="Cost", points=[("2026-12-01", 0), ("2026-12-02", 370_000_000)], fmt=usd)
        assert [tick.label for tick in chart.y_ticks] == ["$0.00", "$1.00", "$2.00", "$3.00", "$4.00"]
        assert chart.y_ticks[0].at == chart.baseline and chart.y_ticks[-1].at == chart.baseline - HEIGHT

    def test_it_labels_the_date_axis_with_a_few_days_first_and_last_included(self) -> None:
        points = [(f"2026-11-{day:02d}", day) for day in range(1, 31)]
        labels = [tick.label for tick in bar_chart(title="t", points=points).x_ticks]
        assert labels[0] == "11-01" and labels[-1] == "11-30" and 3 <= len(labels) <= X_TICKS

    def test_nice_ceilings_are_round_and_split_into_whole_steps(self) -> None:
        assert [nice_ceiling(v) for v in (0, 1, 4, 5, 9, 37, 123_456_789)] == [4, 4, 4, 8, 20, 40, 200_000_000]

    def test_it_draws_empty_bars_when_everything_is_zero(self) -> None:
        chart = bar_chart(title="t", points=[("a", 0), ("b", 0)], fmt=usd)
        assert [bar.height for bar in chart.bars] == [0, 0] and chart.peak == "$0.00"
        assert bar_chart(title="t", points=[]).bars == []


class MoneyTests:
    def test_it_writes_whole_cents_with_two_decimals_and_finer_amounts_exactly(self) -> None:
        assert usd(500_000_000) == "$5.00"
        assert usd(123_456_789_00) == "$123.456789"
        assert usd(1) == "$0.00000001"
        assert usd(-300_000_000) == "-$3.00"
        assert usd(None) == "$0.00"
        assert per_million(10) == "$0.10" and per_million(40) == "$0.40"
