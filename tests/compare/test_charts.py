"""The timeline chart as a spec: step lines corner exactly where a value changes, round integer
ticks from 0, levels and counters the timeline lacks draw nothing, marks carry their ids, escaped
tooltips and links, the x axis reaches every mark, and the same input gives the same bytes."""

import xml.etree.ElementTree as ET

import pytest

from compare.charts import (
    Mark,
    Panel,
    chart_x_range,
    nice_step,
    step_corners,
    timeline_svg,
    x_ticks,
    y_ticks,
)
from compare.records import Timeline

SVG = "{http://www.w3.org/2000/svg}"
XLINK_HREF = "{http://www.w3.org/1999/xlink}href"
TIMELINE = Timeline(
    first_step=10,
    counters={"held": [0, 2, 2, 5], "events": [1, 0, 0, 1]},
    levels={"capacity": 6},
)
PANELS = (Panel("held", ("held", "missing"), ("capacity", "absent")), Panel("events", ("events",)))
LABELS = {"held": "pages held", "capacity": "pool"}


def chart(timeline=TIMELINE, panels=PANELS, marks=(), chart_id="c0"):
    return ET.fromstring(timeline_svg(timeline, panels, LABELS, marks, chart_id))


def texts(element) -> list[str]:
    return ["".join(t.itertext()) for t in element.iter(f"{SVG}text")]


def test_a_step_line_corners_only_where_the_value_changes_and_holds_to_the_end_of_its_step():
    assert step_corners(10, [0, 2, 2, 5]) == [(10, 0), (11, 0), (11, 2), (13, 2), (13, 5), (14, 5)]
    assert step_corners(3, [7, 7, 7]) == [(3, 7), (6, 7)]
    assert step_corners(0, []) == []


def test_each_counter_the_timeline_has_is_one_polyline_whose_vertices_are_its_corners():
    polylines = list(chart().iter(f"{SVG}polyline"))
    vertices = [
        [tuple(int(n) for n in point.split(",")) for point in line.get("points").split()]
        for line in polylines
    ]
    assert vertices == [step_corners(10, [0, 2, 2, 5]), step_corners(10, [1, 0, 0, 1])]
    assert len({p.get("stroke") for p in polylines}) == 1  # each panel starts the palette anew


def test_the_data_transform_puts_the_x_range_across_the_frame_and_0_at_its_bottom():
    svg = chart()
    frame = svg.find(f"{SVG}rect")  # the first panel's plot area
    [group] = [g for g in svg.iter(f"{SVG}g") if g.find(f"{SVG}polyline") is not None][:1]
    x_scale, _, _, y_scale, x_shift, y_shift = map(
        float, group.get("transform").removeprefix("matrix(").removesuffix(")").split()
    )
    left, width = float(frame.get("x")), float(frame.get("width"))
    top, height = float(frame.get("y")), float(frame.get("height"))
    assert (x_scale * 10 + x_shift, x_scale * 14 + x_shift) == pytest.approx((left, left + width))
    # y from 0 to 6: held reaches 5, its capacity is 6, so ticks of 2 up to 6
    assert (y_shift, y_scale * 6 + y_shift) == pytest.approx((top + height, top))


def test_the_legend_lists_what_is_drawn_by_label_and_leaves_out_what_the_timeline_lacks():
    legend = [t for t in texts(chart()) if not t.lstrip("-").isdigit()]
    # counters (label, else name) then levels, then each panel's title, then the x axis label
    assert sorted(legend) == sorted(["pages held", "pool", "held", "events", "events", "step"])
    assert "missing" not in legend and "absent" not in legend


def test_a_level_is_a_dashed_line_and_a_level_absent_from_the_timeline_draws_nothing():
    def dashed(element):
        return [line for line in element.iter(f"{SVG}line") if line.get("stroke-dasharray")]

    with_level = dashed(chart())
    without = dashed(chart(TIMELINE.model_copy(update={"levels": {}})))
    assert len(with_level) == 2  # the level across the panel and its legend swatch
    assert without == []


@pytest.mark.parametrize(
    ("high", "ticks"),
    [
        (0, [0, 1]),
        (1, [0, 1]),
        (7, [0, 2, 4, 6, 8]),
        (50, [0, 20, 40, 60]),
        (1000, [0, 250, 500, 750, 1000]),
    ],
)
def test_y_ticks_are_round_integers_from_0_at_most_four_intervals_and_reach_the_max(high, ticks):
    assert y_ticks(0, high) == ticks


def test_each_panel_labels_its_y_ticks_and_the_last_panel_its_x_ticks():
    labels = [t for t in texts(chart()) if t.isdigit()]
    # held: 0 .. 5 and its capacity 6; events: 0 .. 1; x: steps 10 .. 14
    assert labels == ["0", "2", "4", "6", "0", "1", "10", "11", "12", "13", "14"]


def test_y_ticks_reach_below_0_for_a_negative_value_and_the_chart_labels_exactly_those():
    assert y_ticks(-3, 7) == [-5, 0, 5, 10]
    assert y_ticks(-1, 7) == [-2, 0, 2, 4, 6, 8]
    timeline = Timeline(first_step=0, counters={"held": [-1, 7]})
    labels = [t for t in texts(chart(timeline, (Panel("held", ("held",)),))) if t != "held"]
    assert labels[:6] == ["-2", "0", "2", "4", "6", "8"]


def test_nice_steps_are_1_2_2_5_or_5_times_a_power_of_ten_and_whole():
    assert [nice_step(span, 4) for span in (0, 4, 5, 9, 90, 100, 101, 4000)] == [
        1, 1, 2, 5, 25, 25, 50, 1000,
    ]  # fmt: skip


def test_x_ticks_are_the_round_steps_inside_the_range():
    assert x_ticks(10, 14) == [10, 11, 12, 13, 14]
    assert x_ticks(3, 801) == [100, 200, 300, 400, 500, 600, 700, 800]


def test_the_x_range_runs_to_the_end_of_the_last_step_and_widens_to_every_mark():
    assert chart_x_range(TIMELINE, []) == (10, 14)
    assert chart_x_range(TIMELINE, [Mark(20, "", "#a"), Mark(4, "", "#b")]) == (4, 20)
    empty = Timeline(first_step=5, counters={})
    assert chart_x_range(empty, []) == (5, 6)


def test_a_mark_past_the_last_step_lies_inside_the_plot_area():
    svg = chart(marks=[Mark(20, "late", "#d-0-0")])
    frame = svg.find(f"{SVG}rect")  # the first panel's plot area
    right = float(frame.get("x")) + float(frame.get("width"))
    [triangle] = svg.iter(f"{SVG}polygon")
    tip_x = float(triangle.get("points").split()[-1].split(",")[0])
    assert tip_x == right  # the step the x axis ends at


def test_marks_have_ids_from_the_chart_id_escaped_tooltips_and_same_tab_links():
    marks = [Mark(11, "step 11: <script>\x1b", "#d-0-0"), Mark(13, "step 13", "#d-0-4")]
    svg = chart(marks=marks, chart_id="c7")
    groups = [g for g in svg.iter(f"{SVG}g") if g.get("id")]
    assert [g.get("id") for g in groups] == ["c7-mark-0", "c7-mark-1"]
    assert ["".join(g.find(f"{SVG}title").itertext()) for g in groups] == [
        "step 11: <script>\\x1b", "step 13",
    ]  # fmt: skip
    links = [(a.get(XLINK_HREF), a.get("target")) for a in svg.iter(f"{SVG}a")]
    assert links == [("#d-0-0", None), ("#d-0-4", None)]
    [ticks] = [g for g in svg.iter(f"{SVG}g") if g.get("stroke") == "crimson"]
    assert len(ticks.findall(f"{SVG}line")) == 2 * 2  # a line per mark across each panel


def test_every_id_derives_from_the_chart_id():
    svg = chart(marks=[Mark(11, "a", "#x")], chart_id="run-3")
    ids = [element.get("id") for element in svg.iter() if element.get("id")]
    assert ids == ["run-3-mark-0"]


def test_labels_and_titles_from_anyone_are_text():
    svg = timeline_svg(TIMELINE, (Panel("<b>held</b>", ("held",)),), {"held": "<i>x</i>"}, (), "c0")
    assert "&lt;b&gt;held&lt;/b&gt;" in svg and "&lt;i&gt;x&lt;/i&gt;" in svg
    assert "<b>" not in svg and "<i>" not in svg


def test_the_chart_is_an_svg_element_scaled_by_its_viewbox_with_no_script_or_handler():
    source = timeline_svg(TIMELINE, PANELS, LABELS, [Mark(11, "a", "#x")], "c0")
    svg = ET.fromstring(source)
    assert source.startswith("<svg ") and svg.tag == f"{SVG}svg"
    assert svg.get("width") == "100%" and svg.get("viewBox").startswith("0 0 ")
    tags = {element.tag.rpartition("}")[2] for element in svg.iter()}
    assert not tags & {"script", "foreignObject", "image", "style"}
    assert not [name for e in svg.iter() for name in e.attrib if name.lower().startswith("on")]


def test_the_same_input_gives_the_same_string():
    marks = [Mark(11, "a", "#x")]
    first = timeline_svg(TIMELINE, PANELS, LABELS, marks, "c0")
    again = timeline_svg(TIMELINE.model_copy(), PANELS, dict(LABELS), list(marks), "c0")
    assert first == again
