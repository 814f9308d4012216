//! The bench's latency picture: per scenario, the latency distribution of shardlock and of its
//! baseline (quantile against milliseconds, log scale), as SVG.

use std::path::Path;

use plotters::prelude::*;

use crate::AnyError;

/// One scenario's panel: each series is (name, [(quantile, ms)]).
pub(crate) struct Panel<'a> {
    pub(crate) title: String,
    pub(crate) series: Vec<(&'a str, &'a [(f64, f64)])>,
}

/// Writes the panels that have latencies, one under the other, to `path`.
pub(crate) fn latency_svg(panels: &[Panel<'_>], path: &Path) -> Result<(), AnyError> {
    let panels: Vec<&Panel<'_>> = panels
        .iter()
        .filter(|p| p.series.iter().any(|(_, q)| !q.is_empty()))
        .collect();
    let height = 300 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE)?;
    if panels.is_empty() {
        root.present()?;
        return Ok(());
    }
    let areas = root.split_evenly((panels.len(), 1));
    let colors = [BLUE, RED];
    for (panel, area) in panels.iter().zip(&areas) {
        let points = panel.series.iter().flat_map(|(_, q)| q.iter());
        let (low, high) = points.fold((f64::MAX, 0f64), |(lo, hi), &(_, ms)| {
            (lo.min(ms.max(0.001)), hi.max(ms))
        });
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(50)
            .build_cartesian_2d((low * 0.8..high * 1.25).log_scale(), 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc("latency, ms (log)")
            .y_desc("share of ops at or below")
            .draw()?;
        for ((name, quantiles), color) in panel.series.iter().zip(colors) {
            chart
                .draw_series(LineSeries::new(
                    quantiles.iter().map(|&(q, ms)| (ms.max(0.001), q)),
                    color.stroke_width(2),
                ))?
                .label(*name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
