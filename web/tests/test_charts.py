from __future__ import annotations

from catalog.money import per_million, usd
from web.charts import HEIGHT, WIDTH, bar_chart


class BarChartTests:
    def test_it_scales_the_tallest_bar_to_the_plot_and_keeps_bars_inside_it(self) -> None:
        chart = bar_chart(title="t", points=[("a", 1), ("b", 4), ("c", 0)])
        plot = HEIGHT
        assert [bar.height for bar in chart.bars] == [plot / 4, plot, 0]
        assert all(0 <= bar.x and bar.x + bar.width <= WIDTH and bar.y + bar.height == plot for bar in chart.bars)
        assert (chart.first_label, chart.last_label, chart.peak) == ("a", "c", "4")

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
